#!/usr/bin/env bash
# Regenerate docs/run-kill-join.png (README, docs/index.md, docs/observability.md): a 3-worker digits run whose
# worker 1 is killed at step 120 and replaced (launcher.restart_failed), plotted by `elasticflow plot`.
# The figure's title is the run directory as given: runs/kill-join. ~30 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf runs/kill-join
EF_PROBE_KILL=1:120:forward EF_PROBE_SLEEP=0.004 .venv/bin/elasticflow train tests/models/digits_probe.py \
    launcher.workers=3 launcher.restart_failed=true trainer.max_steps=400 trainer.log_every=1 \
    trainer.progress=false hydra.run.dir=runs/kill-join >/dev/null
.venv/bin/elasticflow plot runs/kill-join -o docs/run-kill-join.png
rm -rf runs/kill-join

#!/usr/bin/env bash
# Regenerate docs/run-kill-join.png (README, docs/index.md, docs/observability.md): a 3-worker digits run whose
# worker 1 is killed at step 120 and replaced (launcher.restart_failed), evaluated every 20 steps with the best
# checkpoint kept and early stopping on eval_loss, plotted by `elasticflow plot`.
# The figure's title is the run directory as given: runs/kill-join. ~30 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf runs/kill-join
EF_PROBE_KILL=1:120:forward EF_PROBE_SLEEP=0.01 .venv/bin/elasticflow train tests/models/digits_probe_eval.py \
    launcher.workers=3 launcher.restart_failed=true trainer.max_steps=400 trainer.log_every=1 \
    trainer.eval_every=20 checkpoint.monitor=eval_loss callbacks.early_stopping.monitor=eval_loss \
    callbacks.early_stopping.min_delta=0.01 optimizer.momentum=0.9 optimizer.schedule=cosine optimizer.warmup_steps=40 \
    trainer.progress=false hydra.run.dir=runs/kill-join >/dev/null
.venv/bin/elasticflow plot runs/kill-join -o docs/run-kill-join.png
rm -rf runs/kill-join

"""tests/models/digits_probe.py (fault injection, sample recording) with held-out data and a callback of its
own, for tests/test_callbacks.py.

model_args (all optional):
    stop_at   the rank-0 callback asks to stop at this step (``trainer.request_stop``): every worker ends
              after the next step
    log       a file: the callback appends one JSON line per hook it ran on this worker (hook, step, rank,
              world_size, generation)
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_probe import data, forward, model  # noqa: E402,F401
from digits_mlp import eval_data  # noqa: E402,F401  (digits_probe put models/ on the path)

import elasticflow  # noqa: E402


class Probe(elasticflow.Callback):
    """Rank 0's: logs each hook, adds ``probe_world`` to every step record, stops on request."""

    ranks = "zero"

    def __init__(self, stop_at, log):
        self.stop_at, self.log, self.calls = stop_at, log, 0

    def _note(self, hook, trainer, **extra):
        self.calls += 1
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"hook": hook, "step": trainer.step_count, "rank": trainer.rank, "pid": os.getpid(),
                                    "world_size": trainer.world, "generation": trainer.generation, **extra}) + "\n")

    def on_train_start(self, trainer):
        self._note("train_start", trainer)

    def on_step_end(self, trainer, metrics):
        metrics["probe_world"] = trainer.world
        if trainer.step_count == self.stop_at:
            self._note("stop_asked", trainer)
            trainer.request_stop(f"the probe asked at step {self.stop_at}")

    def on_eval_end(self, trainer, metrics):
        self._note("eval_end", trainer, eval_loss=metrics["eval_loss"])

    def on_save(self, trainer, name, path):
        self._note("save", trainer, name=name, path=path)

    def on_membership_change(self, trainer, world_size, generation):
        self._note("membership_change", trainer)

    def on_train_end(self, trainer, result):
        self._note("train_end", trainer)
        result["probe_calls"] = self.calls


def callbacks(cfg):
    args = cfg.model_args
    return [Probe(args.get("stop_at"), args.get("log"))]

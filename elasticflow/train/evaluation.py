"""Evaluation over ``eval_data()``: each worker evaluates its share in evaluation mode, the sums are reduced.

Also the one-time probe of forward()'s metric names, which fixes the order every worker reduces in.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..backends.common import WEIGHT
from ..data import order as data
from . import randomness
from ..errors import ElasticFlowError

log = logging.getLogger("elasticflow")
# The backends name the evaluation in their loss checks (common.check_loss's ``where``); the probe is
# evaluation mode too, but a user without eval_data() must read where it really ran.
_PROBE = "in the start-up probe (forward() on data()'s first samples, before the first step)"


@dataclass
class Probe:
    metric_names: List[str]  # forward()'s metrics, sorted (its weight last): the order every worker reduces them in
    drew: bool               # forward() called elasticflow.ops.dropout with a rate above 0
    weight: Optional[float] = None  # forward()'s weight per sample in the probe (None: it returns none)


def probe(engine: Any, source: data.Source, check_fields: Optional[Callable[[int], None]] = None) -> Probe:
    """forward() on two samples, once: checks its output early and fixes the metric order every
    worker reduces in (a worker with an empty share still sends zeros for each).

    ``check_fields(n)``: raises when forward() cannot take the batch's ``n`` fields (``ModelFile.check_fields``).
    """
    n = min(2, len(source))
    batch = source.rows(np.arange(n))
    if check_fields is not None:
        check_fields(len(batch))
    drawn = randomness.ops_draws
    engine.train_mode(False)
    try:
        out = engine.evaluate(batch)
    except ElasticFlowError as exc:
        raise ElasticFlowError(exc.message.replace("in evaluation", _PROBE), exc.hint, exc.exit_code) from exc
    finally:
        engine.train_mode(True)
    # forward()'s weight is reduced last, as a sum: the step divides the others' weighted sums by it.
    names = sorted(k for k in out if k not in ("loss", WEIGHT)) + ([WEIGHT] if WEIGHT in out else [])
    weight = float(out[WEIGHT]) / n if WEIGHT in out else None  # per sample
    return Probe(names, randomness.ops_draws > drawn, weight)


class Evaluation:
    """Mean loss and metrics over an eval dataset, as ``{"eval_loss": ..., "eval_<metric>": ...}``.

    Args:
        dataset: what ``eval_data()`` returned, checked.
        backend: the backend module (the dataset is converted to its tensors at the first run).
        metric_names: the order in which the members reduce the metrics.
        chunk: samples per forward call (``trainer.micro_batch_size`` or the global batch).
        exact: ``trainer.reproducible``: chunks cut in global order and dealt whole, their sums exact
            (``Replica.sum_exactly``), so the result is the same for any number of workers.
    """

    def __init__(self, dataset: data.Dataset, backend: Any, metric_names: List[str], chunk: int,
                 exact: bool = False):
        self.dataset, self.backend = dataset, backend
        self.names = ["loss", *metric_names]
        self.chunk, self.exact = chunk, exact
        self._source: Optional[data.Source] = None  # converted lazily: many runs evaluate only at the end

    def run(self, engine: Any, replica: Any) -> Dict[str, float]:
        """Evaluate this member's share and sum over the members (``replica.reduce_sum``).

        Raises CommError when a peer fails: the caller recovers and runs it again.
        """
        if self._source is None:
            # The engine's device: eval batches go where the parameters are.
            self._source = data.Source(self.dataset, self.backend, engine.placement)
        source, totals, rows = self._source, [0.0] * len(self.names), []
        if self.exact:  # whole chunks of the global order: the same chunks for any number of workers
            chunks = data.deal((0, len(source)), replica.rank, replica.world, self.chunk).micro
        else:
            lo, hi = data.worker_share((0, len(source)), replica.rank, replica.world)
            chunks = [(a, min(a + self.chunk, hi)) for a in range(lo, hi, self.chunk)]
        engine.train_mode(False)
        try:
            with replica.whole_params():  # trainer.shard=parameters: every parameter in, given back after
                for a, b in chunks:
                    values = engine.evaluate(source.rows(np.arange(a, b)))
                    weight = values.get(WEIGHT, b - a)  # forward()'s (target tokens), else the samples
                    rows.append([weight if k == WEIGHT else values.get(k, 0.0) * weight for k in self.names])
                    totals = [t + v for t, v in zip(totals, rows[-1])]
        finally:
            engine.train_mode(True)
        summed = replica.sum_exactly(rows, len(self.names)) if self.exact else replica.reduce_sum(totals)
        totals = dict(zip(self.names, summed))
        total = totals.pop(WEIGHT, len(source))
        result = {f"eval_{k}": v / total if total else float("nan") for k, v in totals.items()}  # weighs nothing
        if WEIGHT in self.names:
            result[f"eval_{WEIGHT}"] = total
        return result


def report(run_log: Any, state: Any, result: Dict[str, float], seconds: float) -> None:
    """Rank 0's record of an evaluation: a line in metrics.jsonl (and the trackers) and one on the console."""
    run_log.eval({"step": state.step, "epoch": state.cursor.epoch, **result, "evaluation_s": round(seconds, 4),
                  "time": time.time()})
    log.info("eval at step %d: %s", state.step, " ".join(f"{k}={v:.4g}" for k, v in result.items()))

"""Callbacks: your code at the loop's events, and the built-in ones (early stopping, best-k checkpoints, the
learning-rate monitor). Lightning's ``Callback`` and Keras's ``keras.callbacks.Callback``, made elastic.

Two rules keep a callback from breaking exactness (the run equals the 1-worker run through kills and joins):

- **It never changes the step.** Hooks run between steps; they read values every worker holds alike (the
  step's record holds the reduced loss and metrics, an evaluation's result is reduced over the workers) and
  may add keys to a record, which are logged with it.
- **A stop is agreed.** ``trainer.request_stop(reason)`` from a callback that runs on every rank
  (``ranks = "all"``) stops every rank at this step boundary: each decided it from the same values and the
  same state. From a rank-0 callback (``ranks = "zero"``) the request is a vote in the next step's reduction,
  and every rank stops after that step, one step later, with any number of workers.

A callback's ``state_dict()`` (JSON-able) is kept in every checkpoint and handed to a worker that joins, so
early stopping's patience and the best-k list survive kills and resumes. A ``ranks="zero"`` callback's state
is rank 0's: a callback whose state must survive losing rank 0 runs on every rank.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from ..errors import ElasticFlowError
from .state import count

RANKS = ("zero", "all")
MODES = ("min", "max")


class Callback:
    """Subclass and override the hooks you need; every hook is optional.

    Attributes:
        ranks: ``"zero"`` (rank 0 alone runs it: logging, notifications) or ``"all"`` (every worker runs it; it
            must decide only from the values every worker holds alike).

    Example (a model file's ``callbacks(cfg)``, or ``callbacks.extra`` in the config):
        >>> class PrintEvalLoss(Callback):
        ...     def on_eval_end(self, trainer, metrics):
        ...         print(f"step {trainer.step_count}: eval_loss {metrics['eval_loss']:.4f}")

    Note:
        Hooks run at step boundaries on the training thread: a slow hook slows every step.
    """

    ranks = "zero"

    def on_train_start(self, trainer: Any) -> None:
        """After ``prepare()``: the model is built and a checkpoint (if any) resumed."""

    def on_step_end(self, trainer: Any, metrics: Dict[str, Any]) -> None:
        """After each optimizer step, with its record (``step``, ``loss``, ``lr``, your metrics, ...); keys you
        add are logged with it. (A record is written as the next step reduces, by whoever is rank 0 then: keys
        that must be on every record come from a ``ranks="all"`` callback.)"""

    def on_eval_end(self, trainer: Any, metrics: Dict[str, float]) -> None:
        """After each evaluation, with its result (``eval_loss``, ``eval_<metric>``)."""

    def on_save(self, trainer: Any, name: str, path: Optional[str]) -> None:
        """After checkpoint ``name`` is saved (``path``: on rank 0; None elsewhere). An interval save may still
        be being written in the background (``checkpoint.async_save``)."""

    def on_membership_change(self, trainer: Any, world_size: int, generation: int) -> None:
        """At the first step boundary in a new membership (a worker died, left or joined)."""

    def on_train_end(self, trainer: Any, result: Dict[str, Any]) -> None:
        """After the final checkpoint, with what ``fit()`` returns; keys you add are returned."""

    def state_dict(self) -> Dict[str, Any]:
        """What to keep in checkpoints (JSON-able)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take back what ``state_dict()`` returned (from a checkpoint, or from a peer when joining)."""


class Monitor:
    """A monitored metric: which is better, and when it is read (eval_* at evaluations, others at every step)."""

    def __init__(self, owner: str, monitor: str, mode: str, min_delta: float = 0.0):
        if mode not in MODES:
            raise ElasticFlowError(f"{owner}: mode={mode!r} is not min or max",
                                   "pass mode=min (lower is better, as a loss) or mode=max (as an accuracy)")
        if min_delta < 0:
            raise ElasticFlowError(f"{owner}: min_delta={min_delta} is negative", "pass min_delta >= 0")
        self.owner, self.name, self.mode, self.min_delta = owner, monitor, mode, float(min_delta)
        self.at_eval = monitor.startswith("eval_")

    def check(self, trainer: Any) -> None:
        """Refuse, at train start, a metric this run never produces (it would silently never be judged)."""
        steps = ["loss", *trainer.metric_names]
        evals = [f"eval_{k}" for k in steps] if trainer.evaluation is not None else []
        if self.name not in steps + evals:
            raise ElasticFlowError(f"{self.owner} monitors {self.name!r}, which this run does not produce "
                                   f"(it has: {', '.join(steps + evals)})",
                                   "monitor one of those; eval_* metrics need eval_data() in the model file")

    def value(self, metrics: Dict[str, Any]) -> Optional[float]:
        value = metrics.get(self.name)
        return None if value is None else float(value)

    def better(self, value: float, than: Optional[float], delta: float = 0.0) -> bool:
        """``value`` improves on ``than`` by more than ``delta`` (NaN never does)."""
        if math.isnan(value):
            return False
        if than is None:
            return True
        return value < than - delta if self.mode == "min" else value > than + delta


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` checks in a row
    (Lightning's and Keras's ``EarlyStopping``). An ``eval_*`` metric is checked at each evaluation
    (``trainer.eval_every``); a step metric (``loss``, your metrics) at every step. A NaN value stops at once.

    Runs on every rank (each decides from the same reduced values), so the stop is at the check's own step on
    every worker, as in the 1-worker run. A resumed run that had stopped stops again at once, unless a larger
    ``patience`` leaves it room.

    Example:
        >>> EarlyStopping("eval_loss", patience=3)  # or: callbacks.early_stopping.monitor=eval_loss
    """

    ranks = "all"

    def __init__(self, monitor: str = "eval_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        if patience < 1:
            raise ElasticFlowError(f"EarlyStopping: patience={patience} is below 1",
                                   "pass patience >= 1: the checks without improvement before stopping")
        self.monitor = Monitor("EarlyStopping", monitor, mode, min_delta)
        self.patience = int(patience)
        self.best: Optional[float] = None
        self.wait = 0                   # checks in a row without improvement
        self.stopped_step: Optional[int] = None

    def on_train_start(self, trainer: Any) -> None:
        self.monitor.check(trainer)
        if self.monitor.at_eval and not trainer.tcfg.eval_every:
            raise ElasticFlowError(f"early stopping on {self.monitor.name} is checked at each evaluation, and this "
                                   "run evaluates only at its end", "set trainer.eval_every=N (steps)")
        if self.stopped_step is not None and self.wait >= self.patience:
            trainer.request_stop(f"early stopping had stopped this run at step {self.stopped_step}: "
                                 f"{self.monitor.name} did not improve for {self.wait} checks (pass a larger "
                                 f"patience to train on)")

    def on_step_end(self, trainer: Any, metrics: Dict[str, Any]) -> None:
        if not self.monitor.at_eval and not metrics.get("skipped"):
            self._judge(trainer, metrics)

    def on_eval_end(self, trainer: Any, metrics: Dict[str, float]) -> None:
        if self.monitor.at_eval:
            self._judge(trainer, metrics)

    def _judge(self, trainer: Any, metrics: Dict[str, Any]) -> None:
        value = self.monitor.value(metrics)
        if value is None:
            return
        if self.monitor.better(value, self.best, self.monitor.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait = self.patience if math.isnan(value) else self.wait + 1
        if self.wait >= self.patience:
            self.stopped_step = trainer.step_count
            trainer.request_stop(f"early stopping: {self.monitor.name}={value:.6g} did not improve on "
                                 f"{self.best if self.best is None else f'{self.best:.6g}'} for {self.wait} "
                                 f"check(s)")

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_step": self.stopped_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        best, stopped = state.get("best"), state.get("stopped_step")
        self.best = None if best is None else float(best)
        self.wait = count(state.get("wait", 0))
        self.stopped_step = None if stopped is None else count(stopped)


class BestCheckpoints(Callback):
    """Keep the ``save_top_k`` checkpoints with the best ``monitor`` (Lightning's ``ModelCheckpoint(monitor,
    save_top_k)``): judged at each evaluation, a value among the best k saves the step's checkpoint, and the
    checkpoints it pushes out of the top k go at the next prune (unless they are among the newest
    ``checkpoint.keep``). Built from ``checkpoint.monitor``, ``checkpoint.mode`` and ``checkpoint.save_top_k``;
    ``fit()`` returns ``best_checkpoint`` and ``best_score``."""

    ranks = "all"  # a save is collective: every member writes its slice

    def __init__(self, monitor: str, mode: str = "min", save_top_k: int = 1):
        if save_top_k < 1:
            raise ElasticFlowError(f"checkpoint.save_top_k={save_top_k} is below 1",
                                   "pass checkpoint.save_top_k >= 1, or checkpoint.monitor=null for none")
        self.monitor = Monitor("checkpoint.monitor", monitor, mode)
        self.k = int(save_top_k)
        self.best: List[List[float]] = []  # [value, step], best first

    def on_train_start(self, trainer: Any) -> None:
        self.monitor.check(trainer)
        if not trainer.tcfg.eval_every:
            raise ElasticFlowError(f"checkpoint.monitor={self.monitor.name} is judged at each evaluation, and this "
                                   "run evaluates only at its end", "set trainer.eval_every=N (steps)")
        trainer.checkpoints.protect(self.names())

    def on_eval_end(self, trainer: Any, metrics: Dict[str, float]) -> None:
        value = self.monitor.value({**trainer.state.last_metrics, **metrics})
        step = trainer.step_count
        if value is None or any(s == step for _, s in self.best):
            return
        if len(self.best) == self.k and not self.monitor.better(value, self.best[-1][0]):
            return
        self.best.append([value, step])
        self.best.sort(key=lambda e: (e[0] if self.monitor.mode == "min" else -e[0], e[1]))
        del self.best[self.k:]
        trainer.checkpoints.protect(self.names())
        if trainer.state.last_saved_step != step:
            trainer.save_checkpoint(f"step_{step}", wait=False)

    def names(self) -> List[str]:
        return [f"step_{int(s)}" for _, s in self.best]

    def on_train_end(self, trainer: Any, result: Dict[str, Any]) -> None:
        if self.best:
            result["best_checkpoint"] = str(trainer.checkpoints.job_dir / self.names()[0])
            result["best_score"] = self.best[0][0]

    def state_dict(self) -> Dict[str, Any]:
        return {"best": [list(e) for e in self.best]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        best = state.get("best", [])
        if not isinstance(best, list) or not all(isinstance(e, list) and len(e) == 2 for e in best):
            raise ValueError(f"best-k checkpoints: expected a list of [value, step], got {best!r:.80}")
        self.best = [[float(v), count(s)] for v, s in best][:self.k]


class LearningRateMonitor(Callback):
    """Add each parameter group's learning rate to the step records as ``lr_group<i>`` (``lr`` is the base
    one's; Lightning's ``LearningRateMonitor``). On with ``callbacks.lr_monitor=true``. An optimizer without
    explicit groups is one group: ``lr_group0`` is then ``lr`` (a monitor that added nothing looked broken)."""

    ranks = "all"  # a record is written by whoever is rank 0 when the next step reduces: every rank adds the keys

    def on_step_end(self, trainer: Any, metrics: Dict[str, Any]) -> None:
        spec, lr = trainer.spec, metrics.get("lr")
        if lr is None:
            return
        for i, group in enumerate(spec.groups):
            metrics[f"lr_group{i}"] = lr * (group.lr / spec.lr if group.lr is not None else 1.0)
        if not spec.groups:
            metrics["lr_group0"] = lr


class Callbacks:
    """The run's callbacks, as the trainer calls them: each on the ranks it declares, the stop requests sorted
    into "at this boundary" (every rank asked) and "vote in the next step" (rank 0 asked), their states keyed
    by position and class name."""

    def __init__(self, callbacks: List[Callback]):
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise ElasticFlowError(f"a callback is a {type(cb).__name__}, not an elasticflow Callback",
                                       "subclass elasticflow.Callback (its hooks: on_step_end, on_eval_end, ...)")
            if getattr(cb, "ranks", None) not in RANKS:
                raise ElasticFlowError(f"{type(cb).__name__}.ranks is {cb.ranks!r}",
                                       "set ranks = 'zero' (rank 0 runs it) or 'all' (every rank runs it)")
        self.callbacks = list(callbacks)
        self.stopping: Optional[str] = None  # agreed: stop at this boundary, why
        self.vote: Optional[str] = None      # rank 0's request, voted in the next step
        self._current: Optional[Callback] = None
        self._generation: Optional[int] = None  # the membership the last step ended in

    def train_start(self, trainer: Any) -> None:
        """``on_train_start``, in the membership the worker joined (not a change)."""
        self._generation = trainer.generation
        self.call("on_train_start", trainer)

    def step_end(self, trainer: Any, metrics: Dict[str, Any]) -> None:
        """``on_membership_change`` at the first boundary in a new membership, then ``on_step_end``."""
        if trainer.generation != self._generation:
            self._generation = trainer.generation
            self.call("on_membership_change", trainer, trainer.world, trainer.generation)
        self.call("on_step_end", trainer, metrics)

    def train_end(self, trainer: Any, result: Dict[str, Any]) -> None:
        """``on_train_end``, with why the run stopped early in ``result`` (``stopped_early``) when it did."""
        if self.stopping:
            result["stopped_early"] = self.stopping
        self.call("on_train_end", trainer, result)

    def call(self, hook: str, trainer: Any, *args: Any) -> None:
        """Run ``hook`` of every callback that runs on this rank."""
        outer = self._current  # a hook may cause another (best-k's save runs on_save inside on_eval_end)
        for cb in self.callbacks:
            if cb.ranks == "all" or trainer.rank == 0:
                self._current = cb
                try:
                    getattr(cb, hook)(trainer, *args)
                finally:
                    self._current = outer

    def request_stop(self, reason: str) -> bool:
        """A callback asks to stop (``ElasticTrainer.request_stop``); outside a hook, as rank 0's vote. Returns
        whether a vote is pending (the replica carries it in the next step's reduction)."""
        if self._current is not None and self._current.ranks == "all":
            self.stopping = self.stopping or reason
        else:
            self.vote = self.vote or reason
        return self.vote is not None

    def state_dict(self) -> Dict[str, Any]:
        return {self._key(i, cb): cb.state_dict() for i, cb in enumerate(self.callbacks)}

    def load_state_dict(self, states: Dict[str, Any]) -> None:
        for i, cb in enumerate(self.callbacks):
            state = states.get(self._key(i, cb))
            if state is not None:
                cb.load_state_dict(dict(state))

    @staticmethod
    def _key(i: int, cb: Callback) -> str:
        return f"{i}:{type(cb).__name__}"


def from_config(cfg: Any, model_file: Any) -> Callbacks:
    """The run's callbacks: the model file's ``callbacks(cfg)``, then ``callbacks.extra`` (Hydra ``_target_``
    entries), then the built-ins the config turns on."""
    out: List[Callback] = []
    if model_file.callbacks is not None:
        given = model_file.call("callbacks", cfg)
        out += list(given) if isinstance(given, (list, tuple)) else [given]
    for entry in cfg.callbacks.extra:
        out.append(_instantiate(entry))
    es = cfg.callbacks.early_stopping
    if es.monitor:
        out.append(EarlyStopping(es.monitor, es.mode, es.patience, es.min_delta))
    if cfg.checkpoint.monitor:
        out.append(BestCheckpoints(cfg.checkpoint.monitor, cfg.checkpoint.mode, cfg.checkpoint.save_top_k))
    if cfg.callbacks.lr_monitor:
        out.append(LearningRateMonitor())
    return Callbacks(out)


def _instantiate(entry: Any) -> Callback:
    """A ``callbacks.extra`` entry, ``{_target_: package.module.Class, arg: value}``, built by Hydra."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    target = OmegaConf.select(entry, "_target_") if OmegaConf.is_config(entry) else dict(entry).get("_target_")
    if not target:
        raise ElasticFlowError(f"callbacks.extra entry {entry} has no _target_",
                               "give each entry its class: {_target_: mypackage.callbacks.MyCallback, arg: 1}")
    try:
        return instantiate(entry)
    except Exception as exc:  # noqa: BLE001 - Hydra wraps the import or constructor error; its text says which
        raise ElasticFlowError(f"callbacks.extra: could not build {target}: {str(exc).splitlines()[0][:200]}",
                               "the class must be importable by its dotted path on every worker, and take "
                               "the entry's other keys as arguments") from None

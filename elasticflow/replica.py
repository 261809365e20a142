"""Keeping every worker's replica of the training state identical, through failures.

- ``reduce_step``: the per-step reduction, one allreduce: the gradient (one flat buffer) followed by
  the loss, the metrics and three agreement flags, so every member decides the same thing at the
  same step: a newer generation is waiting, Ctrl-C was pressed, the agent is gone.
- ``recover``: after a failed collective, drop the group, enter the agent's next generation and
  ``sync_state``: the members compare how many samples each has committed, and if one is ahead
  (it finished the step's reduction before the peer died) its full state is sent to the members
  behind. So no member diverges and at most one step is redone.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Dict, List, Tuple

from .errors import ElasticFlowError
from .distributed import protocol

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import ElasticTrainer

log = logging.getLogger("elasticflow")
FOLD_MAX = 1 << 20  # gradients up to 4 MiB (float32) carry the step's scalars in the same allreduce


def reduce_step(trainer: "ElasticTrainer", scalars: List[float]) -> Tuple[List[float], Dict[str, bool]]:
    """Sum the gradient and ``scalars`` over the members; returns (summed scalars, agreed flags)."""
    m = trainer.membership
    if m is None:
        return scalars, {}
    # The poller may lag behind a generation this worker already entered through a recovery.
    seen = max(m.latest_generation, trainer.generation)
    interrupt, agent_lost = float(trainer._interrupt_requested), float(m.agent_lost)
    if trainer.world == 1:
        return scalars, {"membership": seen > trainer.generation, "interrupt": bool(interrupt),
                         "agent_lost": bool(agent_lost)}
    import torch

    grad = trainer.engine.grad_view()
    extra = scalars + [float(seen), interrupt, agent_lost]
    if grad.numel() <= FOLD_MAX:
        # One collective, not two: each is a round trip every member must be scheduled for, which on
        # a small model costs more than the step's compute. The scalars ride in float32 after the
        # gradient (exact for the flags and generations); the price is copying the gradient in and out.
        buf = torch.cat([grad, torch.tensor(extra, dtype=grad.dtype)])
        m.group.allreduce_(buf)
        grad.copy_(buf[:grad.numel()])
        out = buf[grad.numel():].tolist()
    else:  # bandwidth-bound: a second, tiny round trip costs less than two copies of a big gradient
        m.group.allreduce_(grad)
        vec = torch.tensor(extra, dtype=torch.float64)
        m.group.allreduce_(vec)
        out = vec.tolist()
    n = len(scalars)
    # Every member summed the same numbers, so every member reaches the same verdict.
    agreed = {"membership": out[n] != trainer.generation * trainer.world,
              "interrupt": out[n + 1] > 0, "agent_lost": out[n + 2] > 0}
    return out[:n], agreed


def reduce_sum(trainer: "ElasticTrainer", values: List[float]) -> List[float]:
    if trainer.membership is None or trainer.world == 1:
        return values
    import torch

    vec = torch.tensor(values, dtype=torch.float64)
    trainer.membership.group.allreduce_(vec)
    return vec.tolist()


def replicated_state(trainer: "ElasticTrainer") -> Tuple[dict, dict]:
    state = trainer.engine.state(copy=False)  # views: share_state sends them before anything changes
    state.update(trainer.engine.rng_state())
    meta = {"step": trainer.step_count, "micro_step": trainer.micro_step, "skipped_steps": trainer.skipped_steps,
            "cursor": trainer.cursor.as_dict(), "epochs_completed": trainer.epochs_completed,
            "last_metrics": trainer.last_metrics, "last_saved_step": trainer.last_saved_step}
    return state, meta


def adopt_state(trainer: "ElasticTrainer", state: dict, meta: dict) -> None:
    from .data import Cursor

    trainer.engine.load_state(state, int(meta["step"]))
    trainer.engine.set_rng_state(state)
    trainer.step_count = int(meta["step"])
    trainer.micro_step = int(meta["micro_step"])
    trainer.skipped_steps = int(meta["skipped_steps"])
    trainer.cursor = Cursor(**meta["cursor"])
    trainer.epochs_completed = int(meta["epochs_completed"])
    trainer.last_metrics = dict(meta.get("last_metrics") or {})
    trainer.last_saved_step = meta.get("last_saved_step")


def sync_state(trainer: "ElasticTrainer") -> bool:
    """Make every member's state equal to the most advanced member's; True if any state moved."""
    if trainer.membership is None or trainer.world == 1:
        return False
    import torch

    group = trainer.membership.group
    progress = torch.zeros(trainer.world, dtype=torch.float64)
    progress[trainer.rank] = trainer.cursor.samples_seen
    group.allreduce_(progress)
    best = progress.max()
    if bool((progress == best).all()):
        return False
    src = int((progress == best).nonzero()[0])
    behind = (progress < best).nonzero().flatten().tolist()
    if trainer.rank == src:
        group.share_state(*replicated_state(trainer), src, behind)
    elif trainer.rank in behind:
        adopt_state(trainer, *group.share_state({}, {}, src, behind))
    return True


def catch_up_log(trainer: "ElasticTrainer") -> None:
    """A rank 0 that left may have committed a step it never logged: the new rank 0 logs it
    (``_log_record`` skips steps already in metrics.jsonl)."""
    if trainer.rank == 0 and trainer.last_metrics and trainer._should_log(trainer.last_metrics):
        trainer._log_record(trainer.last_metrics)


def recover(trainer: "ElasticTrainer", reason: str, planned: bool = False) -> None:
    """Enter the agent's next generation (after a failure, or a change agreed at a step boundary)."""
    from .distributed.membership import AgentLost, Removed, StopRequested

    failed_at = time.time()
    trainer.engine.zero_grad()  # a partial step's gradient is discarded
    before = trainer.cursor.samples_seen
    old_generation, old_world = trainer.generation, trainer.world
    if not planned:
        log.warning("worker step %d: %s; rebuilding", trainer.step_count + 1, reason)
        trainer.membership.report_failure()
    stop_reason = None
    while True:
        try:
            try:
                trainer.membership.rebuild(after=trainer.generation)
            except StopRequested as stop:
                stop_reason = stop.reason
            trainer._adopt_membership()
            moved = sync_state(trainer)
            break
        except protocol.CommError as exc:
            log.warning("recovery in generation %d failed (%s); waiting for the next", trainer.generation, exc)
            trainer.membership.report_failure()
            stop_reason = None
        except AgentLost as exc:
            trainer.save_checkpoint(f"step_{trainer.step_count}")
            raise ElasticFlowError(f"the agent (job master) is gone: {exc}",
                                   "rerun the same command: resume=auto continues from the newest checkpoint",
                                   exit_code=protocol.EXIT_AGENT_LOST) from exc
        except Removed as exc:
            log.info("worker %s retired by the agent (%s)", trainer.membership.worker_id, exc)
            raise ElasticFlowError(f"worker {trainer.membership.worker_id} retired: {exc}", "",
                                   exit_code=protocol.EXIT_REMOVED) from exc
    catch_up_log(trainer)
    resumed_at = time.time()
    if trainer.rank == 0:
        trainer.event("recovered" if not planned else "regrouped", generation=trainer.generation,
                      previous_generation=old_generation, world_size=trainer.world, previous_world_size=old_world,
                      reason=reason.splitlines()[0][:200], recovery_s=round(resumed_at - failed_at, 4),
                      # An unplanned failure interrupts one step, which the members redo -- unless one of
                      # them had committed it and the rest adopted its state (rolled forward).
                      rolled_forward=bool(moved), steps_redone=0 if planned or moved else 1,
                      samples_adopted=trainer.cursor.samples_seen - before, step=trainer.step_count)
    if stop_reason is not None:
        trainer.save_checkpoint(f"step_{trainer.step_count}")
        raise ElasticFlowError(f"{stop_reason}; checkpoint written",
                               "resume with the same command (resume=auto), or lower launcher.min_workers",
                               exit_code=protocol.EXIT_BELOW_MIN)

"""The trainer's side of membership changes: entering the job, regrouping after a failed collective or an
agreed change, and falling back to a checkpoint when a slice of sharded state was lost with its holders.

``Regrouper`` acts through the parts it was given (the replica, the progress, the logs, the goodput meter,
the checkpoints) and ``save``, the trainer's own checkpoint call; what ends the run is raised here, after
the checkpoint that lets ``resume=auto`` continue (``checkpoint_and_raise``, the one place that does so).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Tuple

from .._util.context import _context
from ..distributed import protocol
from ..distributed.protocol import CommError
from ..errors import ElasticFlowError
from ..observability.reporting import membership_line
from .._util.envnames import ENV_DEBUG

log = logging.getLogger("elasticflow")


class Regrouper:
    """Membership changes, as the trainer meets them.

    Args:
        replica: the worker's ``replica.Replica``; state: the ``TrainState``; shards: ``ShardedState`` or None.
        checkpoints: the ``CheckpointManager``; run_log, step_log: ``reporting.RunLog``/``StepLog``;
        meter: the goodput ``Meter``; save: ``save(name)`` writes checkpoint ``name`` and waits for it.
    """

    def __init__(self, replica: Any, state: Any, shards: Any, checkpoints: Any, run_log: Any, step_log: Any,
                 meter: Any, save: Callable[[str], Any]):
        self.replica, self.state, self.shards, self.checkpoints = replica, state, shards, checkpoints
        self.run_log, self.step_log, self.meter, self.save = run_log, step_log, meter, save

    def checkpoint_and_raise(self, exc: BaseException) -> None:
        """Write the current step's checkpoint, then raise ``exc``: the run stops where it can resume."""
        self.save(f"step_{self.state.step}")
        raise exc

    def join(self) -> None:
        """Enter the job (a multi-worker run); a worker that joined a running job says what it cost."""
        ready_at = time.time()
        joined = self.replica.join(self.state.cursor.samples_seen)
        self.entered_generation()
        if joined is not None and joined.failure is not None:
            # The first state sync failed (a member died in it, or a stranger connected to a gloo port first and
            # held the connection until the timeout, issue #65): as after a failed step, the next generation and
            # its sync; what ends the run is raised there, a lost slice falls back to the checkpoint.
            self.regroup(joined.failure)
            return
        if joined is not None and (joined.generation > 0 or joined.state_received):
            spawned = float(os.environ.get(protocol.ENV_SPAWNED_AT, ready_at))
            self.run_log.event("joined", worker=self.replica.worker_id, generation=joined.generation,
                               world_size=joined.world, start_s=round(ready_at - spawned, 4),
                               admit_s=round(joined.admit_s, 4), rebuild_s=round(joined.rebuild_s, 4),
                               transfer_s=round(joined.transfer_s, 4), state_received=joined.state_received)
        if self.replica.lost:
            self.fall_back(self.state.step)

    def entered_generation(self) -> None:
        """After joining or regrouping: the process context, and the log's new owner."""
        r = self.replica
        if r.rank == 0 and r.generation > 0:
            self.run_log.take_over()  # a rank 0 that left may have logged steps this worker has not
        _context.rank, _context.world_size, _context.generation = r.rank, r.world, r.generation
        if self.shards is not None:  # scripts/bench/bench_shard.py reads this line from each worker's log
            log.info("sharded optimizer state: %d bytes in %d range(s) (replicated: %d) at world %d",
                     self.shards.slot_bytes(), len(self.shards.held),
                     4 * self.shards.n * len(self.shards.slot_names), r.world)

    def after_failed_step(self, batch: Any, failure: str, attempt_started: float, reduce_started: float,
                          reconciler: Any) -> bool:
        """Regroup after ``failure`` ended an attempt at ``batch`` (begun at ``attempt_started``, its reduction
        at ``reduce_started``). True when the step needs no new attempt: a member had committed it (adopted),
        or a fall back to a checkpoint moved the cursor away from it."""
        failed = time.perf_counter()
        # The attempt's compute, then the time blocked in the collective that failed (detection).
        reduced = reduce_started if reduce_started >= attempt_started else failed
        c = self.state.cursor
        committed = c.epoch > batch.epoch or c.samples_in_epoch >= batch.end  # failed in the allgather
        start = reconciler and reconciler.start_values()
        if start and not committed:  # the failed step's forwards moved the buffers: redo from the start
            self.replica.engine.set_buffers(start)
        self.regroup(failure, (reduced - attempt_started, failed - reduced))
        c = self.state.cursor
        return c.epoch != batch.epoch or c.samples_in_epoch != batch.start

    def until_done(self, call: Callable[[], Any]) -> Tuple[Any, float]:
        """``call()``, a collective every member makes (an evaluation), made again after a regroup each time a
        member fails in it: (its result, the seconds the regroups took, each its own cost)."""
        recovering = 0.0
        while True:
            result, failure = collective(call)
            if failure is None:
                return result, recovering
            recovering += self.regroup(failure)

    def regroup(self, failure: Optional[str], attempt: Tuple[float, float] = (0.0, 0.0)) -> float:
        """Regroup after a failed collective (``failure``: what failed) or an agreed membership change.

        ``attempt``: (compute, blocked) seconds of the step attempt the failure ended. Returns the
        seconds the regroup took; raises what ends the run (retired, agent lost, too few workers).
        """
        s = self.state
        self.step_log.flush()  # while this worker is still the rank 0 that committed the step
        if failure is not None:  # gloo's text: the worker's log (tests/test_shard_kill.py reads it there); the
            # console has the new rank 0's line instead (reporting.membership_line), and with --debug both
            log.warning("worker step %d: %s; rebuilding", s.step + 1, failure,
                        extra={"console": os.environ.get(ENV_DEBUG) == "1"})
        before, before_step = s.cursor.samples_seen, s.step
        m = self.replica.membership
        members_before = list(m.members) if m is not None else []
        r = self.replica.recover(failure, before)
        # Rolled forward: a member had committed the attempt's step, so its compute was kept, not redone; so
        # too where this member had (sharded state: it failed in the step's allgather, after the commit).
        kept = r.rolled_forward or r.committed
        redone_s = 0.0 if kept else attempt[0]
        self.meter.lose(redone_s + attempt[1] + r.recovery_s)
        if r.stop == "removed":
            log.info("worker %s retired by the agent (%s)", self.replica.worker_id, r.stop_reason)
            raise ElasticFlowError(f"worker {self.replica.worker_id} retired: {r.stop_reason}", "",
                                   exit_code=protocol.EXIT_REMOVED)
        if r.stop == "cut_out":  # nothing to save: the job went on without this worker's state
            raise ElasticFlowError(r.stop_reason, "with launcher.restart_failed=true a fresh worker is started in "
                                   "its place and joins as a new member", exit_code=protocol.EXIT_CUT_OUT)
        if r.stop == "agent_lost":
            if self.save(f"step_{s.step}") is not None:
                # This worker wrote the checkpoint (manager._claim): its rank 0, the step records' writer, may
                # be lost with the agent's host; the records it did not write are this worker's to write.
                self.run_log.take_over()
                self.step_log.rewrite(s.last_metrics)
            raise ElasticFlowError(
                f"the agent (job master) is gone: {r.stop_reason}",
                "rerun the same command: resume=auto continues from the newest checkpoint",
                exit_code=protocol.EXIT_AGENT_LOST)
        self.entered_generation()
        if self.replica.rank == 0:
            self.step_log.rewrite(s.last_metrics)  # the records a rank 0 that left may not have written
            said = m and membership_line(before_step + (failure is not None), members_before, m.members, m.record,
                                         failed=failure is not None, redone=not kept, stopping=r.stop == "below_min")
            if said:
                log.info("%s", said)
            reason = failure or "membership change at a step boundary"
            self.run_log.event("regrouped" if failure is None else "recovered", generation=self.replica.generation,
                               previous_generation=r.previous_generation, world_size=self.replica.world,
                               previous_world_size=r.previous_world, reason=reason.splitlines()[0][:200],
                               recovery_s=round(r.recovery_s, 4), transfer_s=round(r.transfer_s, 4),
                               redone_s=round(redone_s, 4), detect_s=round(attempt[1], 4),
                               rolled_forward=r.rolled_forward,
                               **({"shard_elements_moved": self.replica.shard_moved} if self.shards else {}),
                               # An unplanned failure interrupts one step, which the members redo -- unless
                               # one of them had committed it and the rest adopted its state (rolled forward),
                               # or this one had (kept).
                               steps_redone=0 if failure is None or kept else 1,
                               samples_adopted=s.cursor.samples_seen - before, step=s.step)
        if self.replica.lost or self.replica.diverged:
            self.fall_back(before_step)
        if r.stop == "below_min":
            self.checkpoint_and_raise(ElasticFlowError(
                f"{r.stop_reason}; checkpoint written",
                "resume with the same command (resume=auto), or lower launcher.min_workers",
                exit_code=protocol.EXIT_BELOW_MIN))
        return r.recovery_s

    def fall_back(self, step_before: int) -> None:
        """Sharded state with a range nobody holds (its owner and its buddy both gone), or replicas that differ
        with no majority (train/fingerprint.py): every member loads the newest checkpoint they all see (for
        diverged replicas, the newest saved before the last step they agreed on) and takes its own ranges from
        it; the steps since are redone."""
        lost = ", ".join(f"[{a}, {b})" for a, b in self.replica.lost)
        diverged, self.replica.lost, self.replica.diverged = self.replica.diverged, [], None
        found = self.checkpoints.by_step()
        if diverged is not None:
            found = {k: v for k, v in found.items() if k <= diverged[1]}
        step, failure = collective(lambda: self.replica.agree_min(max(found, default=-1)))
        if failure is not None:
            self.regroup(failure)
            return
        if step < 0 or step not in found:
            what = diverged[0] if diverged else (f"the sharded optimizer state of range(s) {lost} was lost with its "
                                                 "owner and its buddy")
            raise ElasticFlowError(f"{what}, and there is no checkpoint to fall back to",
                                   "set checkpoint.interval.steps so a lost slice or a corrupted replica costs only "
                                   "the steps since")
        self.checkpoints.load(found[step])
        if self.shards is not None:
            self.shards.keep_local(self.replica.rank, self.replica.world)
        redone = step_before - self.state.step
        why = ("replicas that differed" if diverged else
               f"sharded state of range(s) {lost} lost with its owner and buddy")
        log.warning("%s: fell back to checkpoint %s (step %d), redoing %d step(s)", why, found[step], step, redone)
        if self.replica.rank == 0:
            self.run_log.event("fell_back", checkpoint=str(found[step]), step=step, steps_redone=redone,
                               lost=lost or "diverged", generation=self.replica.generation,
                               world_size=self.replica.world)


def collective(call: Callable[[], Any]) -> Tuple[Any, Optional[str]]:
    """``(call(), None)``, or ``(None, what failed)`` when a collective in it failed.

    The caller regroups after this returns, never inside an ``except`` block: until the block ends, the
    exception's traceback keeps the failed attempt's frames, and in them the reduction's gloo works, and
    so the dead group's sockets open. A member blocked in a receive from this one would wait for the
    group's timeout (30 s in bench_elastic's kills, 2 in 5) instead of waking at once when they close.
    """
    try:
        return call(), None
    except CommError as exc:
        return None, str(exc)

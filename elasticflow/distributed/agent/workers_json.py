"""RUN_DIR/workers.json: the agent's record of its workers, as `elasticflow status` and `scale` read it.

Rewritten at every change (a generation, an admitted joiner, a restart, a retirement), and once more at
the end with how each worker of the last generation ended.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Optional

from ..._util.fileio import write_atomic
from .. import protocol
from .state import AgentState

log = logging.getLogger("elasticflow")


def write(state: AgentState, action: str = "train") -> None:
    """The agent's workers now, by state (members in rank order), with its restarts and pid."""
    snapshot = {"generation": state.generation, "time": time.time(), "action": action,
                "members": [w.describe(r) for r, w in enumerate(state.members)],
                "joining": [w.describe() for w in [*state.joining.values(), *state.admitted]],
                "retiring": [w.describe() for w in state.retiring],
                "waiting": [w.describe() for w in state.waiting],
                "restarts": state.restarts, "max_restarts": state.cfg.launcher.max_restarts,
                "agent_pid": os.getpid()}
    # Atomic: `elasticflow status` and `scale` read it while the job runs.
    write_atomic(state.run_dir / "workers.json", json.dumps(snapshot, indent=1))


def write_ended(state: AgentState) -> None:
    """The job's last workers.json: the last generation's members (``state.published``, which become its
    ``members``), each with how it ended (`status` of an ended job showed them all as still training)."""
    state.roster.end(state.published, [end_state(w.poll()) for w in state.published])
    try:
        write(state, "ended")
    except OSError as exc:  # in a finally: a status file must not hide the job's own error
        log.warning("could not write the final workers.json: %s", exc)


def end_state(rc: Optional[int]) -> str:
    """How a worker ended, from its exit code, as `elasticflow status` shows it."""
    if rc is None:  # not our child (started by srun elsewhere): its end is not known here
        return "ended"
    if rc < 0:
        try:
            return f"killed ({signal.Signals(-rc).name})"
        except ValueError:
            return f"killed (signal {-rc})"
    return {protocol.EXIT_OK: "finished", protocol.EXIT_INTERRUPTED: "interrupted",
            protocol.EXIT_BELOW_MIN: "stopped (below launcher.min_workers)",
            protocol.EXIT_AGENT_LOST: "stopped (agent lost)",
            protocol.EXIT_REMOVED: "retired"}.get(rc, f"failed (exit code {rc})")

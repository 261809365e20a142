"""scripts/bench/bench_control_plane.py at 4 members: a real agent and store, real Membership objects, and every phase
the script times (the first generation, a join, a kill) reached, so the load script cannot rot unnoticed. No
figure is asserted as a time: timings are the script's to print."""
import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "scripts" / "bench"))
import bench_control_plane  # noqa: E402


@pytest.mark.timeout(90)
@pytest.mark.parametrize("arrivals", ["read", "go"])
def test_four_members_form_take_a_joiner_and_lose_a_silent_one(tmp_path, arrivals):
    """``go``: the members wait for the agent's gen/<g>/go, as a generation of more than DIRECT_ARRIVALS does."""
    args = bench_control_plane.parse(["--procs", "2", "--window-s", "1", "--settle-s", "0.2",
                                      "--heartbeat-timeout", "1", "--deadline", "40"]
                                     + (["--direct-arrivals", "2"] if arrivals == "go" else []))
    row = bench_control_plane.measure(args, 4, tmp_path)  # raises BenchError if a phase is not reached
    assert {k for _, k, _ in bench_control_plane.COLUMNS} <= set(row)
    assert row["ops_per_step_training"] == 0  # the step boundary reads the membership's fields, not the store
    assert row["ops_per_step_membership"] > 0  # the heartbeat thread's beats and polls were counted
    assert row["agent_ops_per_round"] > 0
    assert bench_control_plane.table([row]).splitlines()[1].split()[0] == "4"

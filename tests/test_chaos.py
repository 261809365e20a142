"""The chaos soak, short: 8 random SIGKILLs, SIGSTOPs and `scale` requests against a running
4-worker-max job (scripts/soak/chaos.py --events), then its checks: exit 0, the 1-worker parameters, every
sample once, every generation formed within its timeouts, only stopped workers cut out.

The seed is fixed so that a failure replays (EF_CHAOS_SEED=N picks another: the choices replay, the
timings do not). The faults are counted, not timed: a loaded machine delays them and never skips a family
(timed, 30 s once passed without a single `scale` here). Steps of 0.2 s while the faults land (chaos.py's
default: 0.1) make the job 200 steps; the steps past the soak run at full speed. The 10-minute soak runs
outside the suite (docs/elastic-training.md).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHAOS = [sys.executable, str(REPO / "scripts" / "soak" / "chaos.py")]


def test_short_soak_passes_every_check(tmp_path):
    seed = os.environ.get("EF_CHAOS_SEED", "1")
    proc = subprocess.run(CHAOS + ["--events", "8", "--seed", seed, "--step-sleep", "0.2",
                                   "--keep", str(tmp_path / "soak")],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    replay = (f"replay: scripts/soak/chaos.py --events 8 --seed {seed} --step-sleep 0.2 --keep DIR\n"
              f"{out[-6000:]}")
    assert proc.returncode == 0 and "outcome: PASS" in out, replay
    counts = re.search(r"^events: (\d+) \((.*?);", out, re.M)
    assert counts and int(counts.group(1)) >= 8, replay
    kinds = dict(kv.rsplit(" ", 1) for kv in counts.group(2).split(", "))
    assert {"kill", "stop_short", "scale"} <= set(kinds), replay  # faults of every family happened
    assert any(k in kinds for k in ("stop_long", "stop_retiring")), replay


def test_bad_arguments_get_one_error_line_and_a_hint(tmp_path):
    proc = subprocess.run(CHAOS + ["--duration", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --duration and --step-sleep must be positive seconds, got 0 and 0.1",
                                        "hint: e.g. scripts/soak/chaos.py --duration 75 --seed 1"]
    proc = subprocess.run(CHAOS + ["--min-events", "-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == "error: --min-events must be 0 or more, got -1"
    proc = subprocess.run(CHAOS + ["--events", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0].startswith("error: --events must be at least 4")
    proc = subprocess.run(CHAOS + ["--events", "8", "--duration", "30"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0].startswith("error: --events counts the faults")
    (tmp_path / "taken").mkdir()
    proc = subprocess.run(CHAOS + ["--keep", str(tmp_path / "taken")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --keep {tmp_path / 'taken'} already exists")


def test_replica_check_finds_members_that_began_a_step_apart(tmp_path):
    """The soak's replica check: only the committing generation counts, and one differing member is found."""
    sys.path.insert(0, str(REPO / "scripts" / "soak"))
    import chaos

    folder = tmp_path / "samples" / "params"
    folder.mkdir(parents=True)
    lines = {101: [(0, 1, 5, 7), (0, 2, 5, 7), (0, 3, 5, 1), (1, 3, 5, 1)],  # (worker, step, generation, checksum)
             102: [(1, 1, 5, 7), (1, 2, 5, 9), (1, 3, 6, 4), (1, 3, 5, 1)]}
    for pid, rows in lines.items():
        (folder / f"{pid}.jsonl").write_text("".join(
            f'{{"pid": {pid}, "worker": {w}, "step": {k}, "generation": {g}, "params": {c}}}\n' for w, k, g, c in rows))
    starts, split = chaos.replica_starts(tmp_path, {1: 5, 2: 5, 3: 5})
    assert split == [2]  # step 3's other checksum was in generation 6, which did not commit it
    assert starts[2] == {0: {7}, 1: {9}}


"""scripts/sim/sim_goodput.py: goodput at scale per fault-tolerance policy, from a run's measured costs and published
failure rates. The arithmetic against cases worked by hand, and the command as a user runs it."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "sim"))
import sim_goodput as sim  # noqa: E402

SCRIPT = REPO / "scripts" / "sim" / "sim_goodput.py"
LEDGER = REPO / "docs" / "benchmarks" / "elastic-costs-goodput.json"


def assumptions(**changes) -> "sim.Assumptions":
    base = dict(step_s=10.0, group=8, silent=0.0, loud_detect_s=5.0, nccl_timeout_s=600.0, torchft_timeout_s=60.0,
                restart_s=600.0, ckpt_s=50.0, flash_restart_s=120.0, flash_ckpt_s=2.0, replace_s=600.0,
                ef_silent_s=30.0)
    return sim.Assumptions(**{**base, **changes})


MEASURED = sim.Measured(failure_s=0.2, join_s=0.1, source="by hand")


def test_a_restart_loses_detection_restart_half_an_interval_and_the_checkpoints():
    # Young/Daly: sqrt(2 x 50 x 10,000) = 1,000 s between checkpoints, 5% of the time; per failure
    # 5 + 600 + 500 s of 10,000 s.
    g, why = sim.goodput("restart (torchrun)", 1024, 10_000.0, assumptions(), MEASURED)
    assert why["per_failure_s"] == {"detection": 5.0, "restart": 600.0, "rework": 500.0}
    assert g == pytest.approx(1 - 0.05 - 1105 / 10_000)
    # DLRover's flash checkpoint: sqrt(2 x 2 x 10,000) = 200 s, 1% of the time; 5 + 120 + 100 s a failure.
    g, _ = sim.goodput("restart, in-memory (DLRover flash)", 1024, 10_000.0, assumptions(), MEASURED)
    assert g == pytest.approx(1 - 0.01 - 225 / 10_000)


def test_the_survivors_policies_lose_detection_half_a_step_and_a_groups_capacity_until_the_spare():
    a = assumptions(silent=1.0)  # every failure silent: timeouts (torchft's 60 s, ElasticFlow's measured 30 s)
    g, why = sim.goodput("torchft", 1024, 10_000.0, a, MEASURED)
    assert why["per_failure_s"] == {"detection": 60.0, "step in flight": 5.0, "capacity": 600 * 8 / 1024}
    assert g == pytest.approx(1 - (60 + 5 + 4.6875) / 10_000)
    g, why = sim.goodput("ElasticFlow", 1024, 10_000.0, a, MEASURED)
    assert why["per_failure_s"]["detection"] == 30.0 and why["per_failure_s"]["join"] == 0.1
    assert g == pytest.approx(1 - (30 + 5 + 4.6875 + 0.1) / 10_000)
    # loud failures: ElasticFlow's measured recovery; half and half: the mean of the two
    assert sim.detection(assumptions(silent=0.5), "ElasticFlow", MEASURED) == pytest.approx((0.2 + 30) / 2)


def test_a_recovery_longer_than_the_mttf_is_no_progress_not_a_negative_goodput():
    g, _ = sim.goodput("restart (torchrun)", 100_000, 600.0, assumptions(), MEASURED)
    assert g == 0.0


def test_the_command_prints_every_scale_and_policy_and_bad_input_is_one_line():
    out = subprocess.run([sys.executable, str(SCRIPT), "--goodput", str(LEDGER)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.split("(")[0].strip() in ("1k", "16k", "100k")]
    assert len(rows) == len(sim.SCALES) and all(line.count("%") == len(sim.POLICIES) for line in rows), out.stdout
    for args, what in ((["--silent", "2"], "--silent"), (["--step-s", "nan"], "--step-s")):
        bad = subprocess.run([sys.executable, str(SCRIPT), "--goodput", str(LEDGER), *args], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith(f"error: {what} must be") and "hint:" in bad.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--goodput", str(SCRIPT)], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --goodput") and len(bad.stderr.splitlines()) == 1

"""The test harness itself (tests/harness.py): the rule that says "the same model as the 1-worker run" fails
where it should, the 1-worker reference trains once per session, and no test file imports another."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
import harness
from harness import assert_equivalent

TESTS = Path(__file__).parent
INFO = {"step": 3, "epoch": 0, "cursor": {"epoch": 0, "samples_in_epoch": 48, "samples_seen": 48}}
STATE = {"W": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "b": np.full(8, 0.5, np.float32),
         "rng/torch": np.arange(16, dtype=np.uint8)}


def a_run(folder: Path, state: dict, losses=(1.0, 0.5, 0.25)) -> Path:
    """A run directory as a training run leaves it: a checkpoint and a step record each step."""
    job = folder / "checkpoints" / "job_20250101-000000"
    writer = ckpt.Checkpointer(job)
    writer.save("step_3", state, INFO)
    writer.close()
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "loss": loss}) + "\n"
                                                  for k, loss in enumerate(losses, 1)))
    return folder


def test_the_rule_is_the_relative_difference_of_each_tensor(tmp_path):
    want = a_run(tmp_path / "ref", STATE)
    assert_equivalent(a_run(tmp_path / "same", STATE), want, rtol=0)
    near = {**STATE, "W": STATE["W"] * np.float32(1 + 5e-6)}  # 5e-6 of the tensor, everywhere
    assert_equivalent(a_run(tmp_path / "near", near), want)
    with pytest.raises(AssertionError, match="W: relative difference 5"):
        assert_equivalent(tmp_path / "near", want, rtol=1e-6)
    one_off = {**STATE, "b": STATE["b"].copy()}
    one_off["b"][3] += 1e-3  # one element of eight: 1e-3 / (0.5 * sqrt 8) of the tensor
    with pytest.raises(AssertionError, match="b: relative difference 0.000707 "):
        assert_equivalent(a_run(tmp_path / "off", one_off), want)
    assert_equivalent(tmp_path / "off", want, floor=1e-3)  # the largest difference is within the floor
    other_rng = {**STATE, "rng/torch": STATE["rng/torch"][::-1].copy()}
    assert_equivalent(a_run(tmp_path / "rng", other_rng), want)  # the random streams only where asked
    with pytest.raises(AssertionError, match="rng/torch"):
        assert_equivalent(tmp_path / "rng", want, rng=True)


def test_the_records_and_the_names_are_compared_too(tmp_path):
    want = a_run(tmp_path / "ref", STATE)
    with pytest.raises(AssertionError, match="loss of step 2: relative difference 0.02"):
        assert_equivalent(a_run(tmp_path / "loss", STATE, losses=(1.0, 0.51, 0.25)), want)
    assert_equivalent(tmp_path / "loss", want, records=False)
    with pytest.raises(AssertionError, match="every step logged exactly once"):
        assert_equivalent(a_run(tmp_path / "short", STATE, losses=(1.0, 0.5)), want)
    with pytest.raises(AssertionError, match="tensors differ: \\['extra'\\]"):
        assert_equivalent(a_run(tmp_path / "extra", {**STATE, "extra": np.zeros(2, np.float32)}), want)
    # Against an algorithm written plainly: its tensors, looked up in the run's state.
    assert_equivalent(want, {"W": STATE["W"].astype(np.float64)})
    with pytest.raises(AssertionError, match="not in the run's state: \\['missing'\\]"):
        assert_equivalent(want, {"missing": np.zeros(2)})


def test_the_reference_trains_once_per_key_even_from_two_processes(tmp_path):
    """Two processes (as pytest-xdist's workers) ask for the same reference at once, then one asks for another:
    each key trains once; a run that failed leaves no mark and trains again."""
    script = tmp_path / "ask.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {str(TESTS)!r})
import harness

def fake(run, *overrides, **kw):  # a training run, as far as the cache can tell
    with open({str(tmp_path / 'trained.log')!r}, "a") as log:
        log.write(" ".join(overrides) + "\\n")
    if "fail" in overrides:
        raise AssertionError("the run failed")
    run.mkdir(parents=True)

harness.train_ok = fake
try:
    print(harness.one_worker_run({str(tmp_path / 'refs')!r}, *sys.argv[1:]))
except AssertionError:
    print("failed")
""")
    ask = [sys.executable, str(script)]
    both = [subprocess.Popen(ask + ["a=1"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    runs = [p.communicate(timeout=60)[0].strip() for p in both]
    assert runs[0] == runs[1] and Path(runs[0]).is_dir()
    other = subprocess.run(ask + ["a=2"], capture_output=True, text=True, timeout=60).stdout.strip()
    assert other != runs[0]
    for _ in range(2):
        assert subprocess.run(ask + ["fail"], capture_output=True, text=True, timeout=60).stdout.strip() == "failed"
    assert (tmp_path / "trained.log").read_text().splitlines() == ["a=1", "a=2", "fail", "fail"]


def test_no_test_file_imports_another():
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_") or n == "conftest"]
    assert not found, "a test file imports another (put what they share in tests/harness.py):\n" + "\n".join(found)


def test_the_harness_knows_the_probe_it_starts():
    assert harness.PROBE.is_file() and harness.EXACT.is_file() and harness.SLOW.is_file()

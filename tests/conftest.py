"""Fixtures. The helpers they use (starting a job, waiting, reading what it wrote, the comparison with the
1-worker run) are in tests/harness.py."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

import harness


@pytest.fixture
def write_model(tmp_path):
    """Write a model file from source text; returns its path."""
    def _write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(source)
        return path
    return _write


@pytest.fixture(autouse=True)
def mlflow_uri_stays_in_its_test():
    """``mlflow.set_tracking_uri`` (how a test reads a run back) also sets $MLFLOW_TRACKING_URI in this process, and
    every job a later test starts inherits it: its sidecar then logged into that earlier test's store, and the
    later test found no run (test_trackers.py after test_optim.py in one xdist worker). Put back after each test."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="session")
def one_worker(tmp_path_factory):
    """``one_worker(*overrides, model=PROBE, common=COMMON, record=False)``: the 1-worker run of that job,
    trained once per session (harness.one_worker_run); its run directory, which tests share: read it (or
    resume from it into a run directory of their own), never write into it. Under pytest-xdist the workers of
    a session share the folder, so each reference trains once in all."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/popen-gwK: the session's folder, shared by its workers
    return functools.partial(harness.one_worker_run, base / "references")


@pytest.fixture(scope="session")
def reference(one_worker):
    """The 1-worker run of harness.PROBE with harness.COMMON, which every elastic run must reproduce."""
    return one_worker()


@pytest.fixture(scope="session")
def tf_reference(one_worker):
    """The same on TensorFlow (float32 kernels differ between backends: compare like with like)."""
    pytest.importorskip("tensorflow")
    return one_worker("backend=tensorflow")


# ---------------------------------------------------------------- two processes over the 2 cores
# scripts/test.sh runs the suite in two pytest-xdist workers (--dist loadgroup; pytest<9, see setup.cfg). A file's tests stay in one
# worker, so a module's fixtures build once. The files that use machine-wide resources (SLURM's daemons and
# /etc/slurm, network namespaces and their addresses: tests/slurm_cluster.py, tests/hosts.py) form one group,
# run one at a time, and go first: they are the longest, and the other worker fills in beside them.
MACHINE_WIDE = {"test_hosts.py", "test_failover.py", "test_topology_hosts.py", "test_slurm.py",
                "test_slurm_cluster.py", "test_slurm_grow.py", "test_slurm_hosts.py"}
# Then the files of a minute or more (2026-11-27's `--durations`, and the files added since, from 2026-12-05's),
# longest first, the rest in name order: a long file started last (test_tensorflow*, test_topology*,
# test_shard_params, test_weights_topologies sort late by name) left one worker alone at the end. The suite
# prints each file's total (below): keep this list by it.
LONG_FIRST = ["test_combinations.py", "test_exact.py", "test_shard_params.py", "test_reproducible.py",
              "test_finetune.py", "test_servers.py", "test_shard_frozen.py", "test_elastic.py", "test_chaos.py",
              "test_first_sync.py", "test_checkpoint_crafted.py",
              "test_tensorflow.py", "test_data_forms.py", "test_shard_checkpoint.py", "test_scale.py",
              "test_shard.py", "test_hierarchy.py", "test_kubernetes.py", "test_intruder.py",
              "test_token_weights.py", "test_checkpoint_sharded.py", "test_weights_topologies.py",
              "test_trackers.py", "test_callbacks.py", "test_streams.py", "test_idle_params.py"]


# ---------------------------------------------------------------- the inner loop: scripts/test.sh --quick
# The unit tests (files that start no job, or one or two short ones) and one end-to-end kill per backend: a
# few minutes, for the edit-test loop. CI runs everything. A unit test file joins QUICK_FILES when its total
# (the suite's per-file table) stays a few seconds.
QUICK_FILES = {"test_accumulation.py", "test_affinity.py", "test_agent.py", "test_backends.py", "test_buffers.py",
               "test_checkpoint_crafted.py", "test_checkpoint_finish.py", "test_comm.py", "test_config.py", "test_data.py", "test_fileio.py",
               "test_grad_check.py", "test_imports.py", "test_links.py", "test_modelfile.py", "test_module_size.py",
               "test_ops.py", "test_randomness.py", "test_rendezvous.py", "test_reporting.py", "test_roster.py",
               "test_rounds.py", "test_sealing.py", "test_setup_script.py", "test_signals.py", "test_smoke.py", "test_state.py",
               "test_topology_schema.py", "test_trainer.py", "test_worker.py"}
QUICK_TESTS = {"test_elastic.py::test_kill_one_of_three_by_pid_from_workers_json",
               "test_elastic.py::test_tensorflow_kill_matches_single_worker[one-reduction]"}


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="only the unit tests and one end-to-end kill per backend (conftest.QUICK_FILES, QUICK_TESTS)")


def _quick(item) -> bool:
    return item.path.name in QUICK_FILES or f"{item.path.name}::{item.name}" in QUICK_TESTS


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        config.hook.pytest_deselected(items=[item for item in items if not _quick(item)])
        items[:] = [item for item in items if _quick(item)]
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("machine-wide" if name in MACHINE_WIDE else name))
    def rank(item) -> tuple:
        name = item.path.name
        return name not in MACHINE_WIDE, LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: each file keeps its order


# ---------------------------------------------------------------- where the suite's time goes
# CI prints each file's total beside --durations' slowest tests (scripts/test.sh): the budget is kept by files,
# which is how LONG_FIRST and the groups above are chosen, and a worker's total shows an imbalance between them.
_FILE_SECONDS: dict = {}
_WORKER_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    name = Path(report.nodeid.split("::", 1)[0]).name
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration
    node = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
    _WORKER_SECONDS[node] = _WORKER_SECONDS.get(node, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS or os.environ.get("EF_FILE_DURATIONS", "30") == "0":
        return
    top = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:int(os.environ.get("EF_FILE_DURATIONS", "30"))]
    terminalreporter.write_sep("=", f"slowest files (of {len(_FILE_SECONDS)}; setup + call + teardown)")
    for name, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
    terminalreporter.write_line("busy: " + ", ".join(f"{w} {s:.0f}s" for w, s in sorted(_WORKER_SECONDS.items())))

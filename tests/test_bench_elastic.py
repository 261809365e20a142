"""scripts/bench/bench_elastic.py's --baseline-tree: a before/after is only worth reading if the "before" arm
really imports the other tree. Until 2026-11-25 it did not (``python -m`` in this repository put this
repository's package first, whatever PYTHONPATH said), and every A/B it printed timed one tree twice."""
import shutil
import subprocess
import sys

import pytest

from harness import REPO

sys.path.insert(0, str(REPO / "scripts" / "bench"))
import bench_elastic  # noqa: E402


def test_a_tree_arm_imports_the_tree(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "elasticflow", tree / "elasticflow", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "elasticflow" / "marker_of_the_tree.py").write_text("")
    bench_elastic.check_tree(str(tree))
    cmd = [sys.executable, "-m", "elasticflow.marker_of_the_tree"]  # only the tree's package has it
    for tree_arg, found in ((str(tree), True), (None, False)):  # the baseline's arm, then this repository's
        proc = bench_elastic.Proc(cmd, tmp_path / "arm.log", tree=tree_arg)
        try:
            assert (proc.wait(120) == 0) == found, proc.tail()
        finally:
            proc.close()


def test_a_directory_without_the_package_is_refused(tmp_path):
    with pytest.raises(bench_elastic.BenchError, match="no elasticflow/ package there"):
        bench_elastic.check_tree(str(tmp_path))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_elastic.py"), "--parts", "1",
                           "--baseline-tree", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --baseline-tree {tmp_path}: no elasticflow/")

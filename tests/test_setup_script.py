"""scripts/setup.sh: its options, and a line per phase, checked without installing anything (--dry-run in an empty
copy of the tree: no .venv there, so every phase says what it would install)."""
from __future__ import annotations

import shutil
import subprocess

from harness import REPO


def _setup(tmp_path, *args) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    return subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          timeout=60)


def test_help_names_the_options_and_an_unknown_one_is_refused_in_one_line_with_a_hint(tmp_path):
    shown = _setup(tmp_path, "--help")
    assert shown.returncode == 0 and "--torch-only" in shown.stdout and "--dry-run" in shown.stdout
    refused = _setup(tmp_path, "--cuda")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines()[0].startswith("error: setup.sh: unknown option '--cuda'")
    assert refused.stderr.splitlines()[1].startswith("hint: ")
    assert not (tmp_path / ".venv").exists()


def test_each_phase_prints_a_line_and_torch_only_skips_tensorflow(tmp_path):
    full = _setup(tmp_path, "--dry-run")
    assert full.returncode == 0, full.stderr
    phases = [line for line in full.stdout.splitlines() if line.startswith("setup [")]
    assert [p.split(",")[0] for p in phases] == [f"setup [{k}/6" for k in range(1, 7)], full.stdout
    assert "would run: .venv/bin/python -m pip install --quiet --disable-pip-version-check tensorflow-cpu==2.21.*" \
        in full.stdout
    torch_only = _setup(tmp_path, "--torch-only", "--dry-run")
    assert torch_only.returncode == 0, torch_only.stderr
    assert "tensorflow-cpu: skipped (--torch-only)" in torch_only.stdout
    assert "tensorflow-cpu==" not in torch_only.stdout and "torch==2.13.0" in torch_only.stdout
    assert not (tmp_path / ".venv").exists()   # a dry run installs nothing

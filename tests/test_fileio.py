"""fileio.write_atomic: old or new content and nothing else, on disk before it returns, never written through
a planted symlink, and no temporary left behind whatever fails."""
import errno
import os
import stat

import pytest

from elasticflow._util import fileio
from elasticflow._util.fileio import append_event, open_append


def _strays(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_it_replaces_the_content_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "summary.json"
    fileio.write_atomic(target, '{"a": 1}')
    fileio.write_atomic(str(target), "é ✓")  # a str path too; UTF-8
    assert target.read_text(encoding="utf-8") == "é ✓"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_the_file_then_the_rename_then_the_directory_reach_the_disk(tmp_path, monkeypatch):
    seen = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        fsync(fd)

    def recording_replace(src, dst):
        seen.append(("replace", os.path.basename(src)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    fileio.write_atomic(tmp_path / "a.json", "1")
    fileio.write_atomic(tmp_path / "a.json", "2")
    assert [s if isinstance(s, str) else s[0] for s in seen] == ["file", "replace", "dir"] * 2
    first, second = seen[1][1], seen[4][1]
    # A random temporary name: not the pid (another process could plant it), not the same twice.
    assert first != second and str(os.getpid()) not in first
    assert first.startswith(".a.json.") and first.endswith(".tmp") and len(first) == len(".a.json..tmp") + 16


def test_a_symlink_at_the_old_predictable_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "record.json"
    planted = tmp_path / f".record.json.{os.getpid()}.tmp"  # where the pid-named version wrote
    planted.symlink_to(victim)
    fileio.write_atomic(target, "new")
    assert target.read_text() == "new" and not target.is_symlink()
    assert victim.read_text() == "precious" and planted.is_symlink()


def test_a_symlink_planted_at_the_very_temporary_name_is_refused(tmp_path, monkeypatch):
    """O_EXCL and O_NOFOLLOW: even a guessed name is never written through, and the planted link is not
    the writer's to remove."""
    victim, target = tmp_path / "victim", tmp_path / "record.json"
    victim.write_text("precious")
    target.write_text("old")
    monkeypatch.setattr(fileio.secrets, "token_hex", lambda n: "0" * (2 * n))
    planted = tmp_path / f".record.json.{'0' * 16}.tmp"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        fileio.write_atomic(target, "new")
    assert (victim.read_text(), target.read_text()) == ("precious", "old") and planted.is_symlink()


@pytest.mark.parametrize("failure", ["encode", "fsync", "replace"])
def test_a_failure_mid_write_keeps_the_old_content_and_removes_the_temporary(tmp_path, monkeypatch, failure):
    target = tmp_path / "record.json"
    fileio.write_atomic(target, "old")
    text = "new"
    if failure == "encode":
        text = "new \ud800"  # a lone surrogate: UTF-8 cannot encode it
    else:
        def disk_full(*args):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, failure, disk_full)
    with pytest.raises(UnicodeEncodeError if failure == "encode" else OSError):
        fileio.write_atomic(target, text)
    monkeypatch.undo()
    assert target.read_text() == "old" and _strays(tmp_path) == []


def test_appends_never_go_through_a_planted_symlink(tmp_path):
    """events.jsonl, metrics.jsonl and the worker logs are appended to with O_NOFOLLOW: a symlink planted where
    one goes fails the append (ELOOP) instead of writing into the file it points at."""
    victim = tmp_path / "victim"
    victim.write_text("the owner's file\n")
    planted = tmp_path / "events.jsonl"
    planted.symlink_to(victim)
    with pytest.raises(OSError) as err:
        append_event(planted, "started", "agent")
    assert err.value.errno == errno.ELOOP
    assert victim.read_text() == "the owner's file\n"
    fresh = tmp_path / "metrics.jsonl"
    with open_append(fresh) as f:
        f.write("{}\n")
    assert fresh.read_text() == "{}\n"

"""Where things live: the packaged configs (in the wheel: elasticflow/conf; in a checkout: ./conf), and a run's
checkpoints; who may change them (the checks of the folders a job reads code or config from), and reads that a
rename after the check cannot redirect."""
import errno
import os
import stat
from pathlib import Path
from typing import Any, List, Optional, Sequence

from ..errors import ElasticFlowError, RunDirectoryMoved


def conf_dir() -> Path:
    here = Path(__file__).resolve().parents[1]  # elasticflow/ (this file is elasticflow/_util/paths.py)
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"elasticflow's conf/ directory is missing next to {here}; reinstall the package")


def checkpoint_dir(cfg: Any, run_dir: Path) -> Path:
    """``checkpoint.dir`` (``~`` expanded), else RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def private_group(gid: int, owner: int) -> bool:
    """Whether nobody but this user and ``owner`` is in group ``gid``: a user private group, as under a umask
    of 002, where Hydra's run directories come out group-writable."""
    import grp
    import pwd

    try:
        us = {pwd.getpwuid(uid).pw_name for uid in {os.geteuid(), owner}}
        members = set(grp.getgrgid(gid).gr_mem) | {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid}
    except KeyError:  # a uid or gid without a name: nobody can say who is in it
        return False
    return members <= us


def _shared(st: os.stat_result) -> Optional[str]:
    """Why others may add, rename or remove entries in the directory ``st`` describes, or None: writable by
    others, or by a group that has other members, without the sticky bit (/tmp's, under which only an entry's
    owner may rename or remove it)."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return f"may be written by others (mode {mode:o})"
    if mode & stat.S_IWGRP and not private_group(st.st_gid, st.st_uid):
        return f"may be written by its group, which has other members (mode {mode:o})"
    return None


def _not_yours(st: os.stat_result) -> Optional[str]:
    """Why someone else may change what ``st`` describes: another user owns it, or others (sticky bit or not)
    or a group with other members may write it; None where only you may."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    if mode & stat.S_IWOTH:
        return f"may be written by others (mode {mode:o})"
    if mode & stat.S_IWGRP and not private_group(st.st_gid, st.st_uid):
        return f"may be written by its group, which has other members (mode {mode:o})"
    return None


def _above(path: Path) -> List[Path]:
    """Every directory ``path`` is reached through, nearest first: the parents of the path as written and of
    the one it resolves to (whoever may rename an entry of either can put another directory in its place)."""
    found: List[Path] = []
    for p in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        found += [q for q in p.parents if q not in found]
    return found


def _refuse(what: str, path: Path, problem: str, hint: str) -> None:
    raise ElasticFlowError(f"the {what} {path} {problem}: whoever can write there can change what the job reads "
                           "back and run code as you",
                           f"{hint}, or pass launcher.trust_shared_dirs=true if everyone who can write there is "
                           "trusted")


def refuse_shared_parents(path: Path, what: str) -> None:
    """ElasticFlowError if others may rename an entry of a directory above ``path`` (writable by others, or a
    shared group, without the sticky bit): they could rename ``path`` or one of its parents away and put their
    own in its place, between the job's check and its read."""
    for parent in _above(Path(path)):
        try:
            problem = _shared(os.stat(parent))
        except FileNotFoundError:  # a folder the job makes later: its parents are checked
            continue
        if problem:
            _refuse(what, path, f"lies under {parent}, which {problem}, so it can be renamed away and replaced",
                    f"use a folder whose parents only their owners may write (chmod o-w,g-w {parent}, or chmod +t "
                    f"{parent} as /tmp is)")


def refuse_if_shared(path: Path, what: str) -> None:
    """ElasticFlowError if ``path`` exists and another user owns it, or group or others may write into it (a
    sticky directory like /tmp aside, whose entries only their owner may replace), or if a directory above it
    lets others rename it away (``refuse_shared_parents``). Whoever can write there can swap the files the job
    reads back (config.yaml names the model file the workers import) or plant symlinks where it appends."""
    try:
        st = os.stat(path)  # a symlink to a directory of one's own is fine: what matters is who writes there
    except FileNotFoundError:
        st = None
    if st is not None:
        problem = f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})" if st.st_uid != os.geteuid() \
            else _shared(st)
        if problem:
            _refuse(what, path, problem, f"use a directory of your own (chmod go-w {path})")
    refuse_shared_parents(path, what)


def refuse_code_folder(folder: Path, what: str) -> None:
    """ElasticFlowError if anyone but its owner may add a file to ``folder``, which holds code the job imports
    (the model file's folder is first on ``sys.path`` while it is imported: a stranger's ``numpy.py`` there
    would be imported in numpy's place, sticky bit or not), or if a directory above it is shared."""
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return
    mode = stat.S_IMODE(st.st_mode)
    problem = f"may be written by others (mode {mode:o})" if mode & stat.S_IWOTH else _shared(st)
    if problem:
        _refuse(what, folder, problem, f"keep the model file in a folder only you may write (chmod go-w {folder})")
    refuse_shared_parents(folder, what)


def read_secret(path: Path, setting: str, reach: str, hint: str) -> str:
    """The text of the file ``path`` (``~`` expanded, stripped) that holds a secret of the job (its token, its etcd
    password), named in errors by ``setting`` (``launcher.token_file``). ElasticFlowError where this host cannot
    read it (``hint``), or where its group or others may read it: ``reach`` says what whoever reads it could do
    ("reaches the job's keys")."""
    path = Path(path).expanduser()
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read() if stat.S_ISREG(mode) else None
    except OSError as exc:
        raise ElasticFlowError(f"cannot read {setting}={str(path)!r} ({exc.strerror})", hint) from None
    if text is None:
        raise ElasticFlowError(f"cannot read {setting}={str(path)!r} (not a regular file)", hint)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ElasticFlowError(f"{setting}={str(path)!r} can be read by others (mode {stat.S_IMODE(mode):o}): "
                               f"anyone who reads it {reach}", f"chmod 600 {path}")
    return text.strip()


def identity(path: Path, across_hosts: bool = False) -> str:
    """``"st_dev:st_ino"`` of ``path``: the agent records its run directory's, and each worker checks that the
    directory it opened is that one (``read_beneath``). ``across_hosts``: ``"*:st_ino"``, for workers on other
    hosts (srun's): a shared filesystem's device number differs from host to host, its inode numbers do not, and a
    directory renamed away and replaced has another inode."""
    return _identity(os.stat(path), across_hosts)


def _identity(st: os.stat_result, across_hosts: bool) -> str:
    return f"{'*' if across_hosts else st.st_dev}:{st.st_ino}"


def _not_the_one(where: Path, st: os.stat_result, expect: str) -> ElasticFlowError:
    return ElasticFlowError(f"the run directory {where} is not the one the job started in: it was renamed or "
                            f"replaced since (st_dev:st_ino now {st.st_dev}:{st.st_ino}, at the start {expect}); "
                            "nothing of it was read", "start the job again in a directory whose parents only you "
                            "may write")


class HeldDirectory:
    """The run directory as the job checked it at its start, held open while the job runs: ``check()`` raises
    ``RunDirectoryMoved`` once its path leads to another directory. Whoever may rename it, or a folder above it
    (one others may write, started under ``launcher.trust_shared_dirs=true``, or whose modes were loosened since),
    can put a directory of their own at the path, and what the job writes by path (events, records, checkpoints,
    error records) would go there: the agent checks every round of its loop and stops the job, a worker before
    each checkpoint and before its error record. ``expect``: the ``identity`` the launcher checked (a directory
    already replaced when this opens it is refused like ``read_beneath``'s).

    Note: it narrows the window to the agent's round (10 ms) rather than closing it: a write the job makes by
    path between the swap and the next check goes into the directory put in its place (never through a symlink
    planted there: appends and records are opened with O_NOFOLLOW)."""

    def __init__(self, path: Path, expect: Optional[str] = None):
        self.path, self._fd = Path(path), -1
        self._across = bool(expect and expect.startswith("*:"))
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(self._fd)
        self.identity = _identity(st, self._across)
        if expect is not None and self.identity != expect:
            self.close()
            raise _not_the_one(self.path, st, expect)

    def check(self) -> None:
        """RunDirectoryMoved, with where the directory is now, if its path leads elsewhere (a stat: ~2 us)."""
        try:
            if _identity(os.stat(self.path), self._across) == self.identity:
                return
        except OSError:  # nothing at the path now
            pass
        try:
            now = os.readlink(f"/proc/self/fd/{self._fd}")  # where the directory held open is now
        except OSError:
            now = ""
        where = "it was removed" if not now or now.endswith(" (deleted)") else f"it is now {now}"
        raise RunDirectoryMoved(
            f"the run directory {self.path} was renamed or replaced while the job ran ({where}): the job stopped, "
            "and wrote nothing more into the directory at that path",
            "the checkpoints are in the directory where it is now: make the folders above it writable only by you "
            "(or move it back), then resume there with hydra.run.dir=THAT_DIRECTORY resume=auto", exit_code=1)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = close  # a trainer dropped without its end (an error in a notebook) leaves no descriptor open


def read_beneath(directory: Path, names: Sequence[str], expect: Optional[str] = None, owned: bool = True) -> bytes:
    """The file ``directory/names[0]/.../names[-1]``, read through descriptors opened one below the other with
    ``O_NOFOLLOW``, so that a rename or a symlink planted after a check redirects nothing. ``owned``: every
    directory below ``directory`` and the file must be yours alone (``not_only_yours``); off where another
    host's process wrote them (a Kubernetes volume's owner and modes are its ``fsGroup``'s). ``expect``: the
    ``identity`` ``directory`` must have (the run directory the agent checked, not one put in its place).

    Note: ``directory`` itself is opened by its path: ``refuse_if_shared`` checked who may replace it, and
    ``expect`` tells if it was."""
    where = Path(directory)
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstat(fd)
        if expect is not None and _identity(st, expect.startswith("*:")) != expect:
            raise _not_the_one(where, st, expect)
        for i, name in enumerate(names):
            last = i == len(names) - 1
            where = where / name
            try:
                # O_NONBLOCK: a FIFO in the file's place must not hang the reader (S_ISREG below refuses it)
                nxt = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY),
                              dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise ElasticFlowError(f"{where} is a symlink: the job reads its own files only through "
                                               "the directories it checked", "remove the symlink") from exc
                    raise ElasticFlowError(f"{where} is not a directory", f"remove {where}") from exc
                raise
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            problem = _not_yours(st) if owned else None
            if problem:
                raise ElasticFlowError(f"{where} {problem}: the job reads back only files of its own that nobody "
                                       "else may write", f"remove it, or chmod go-w {where}")
        if not stat.S_ISREG(st.st_mode):
            raise ElasticFlowError(f"{where} is not a regular file", f"remove {where}")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def not_only_yours(path: Path) -> Optional[str]:
    """Why others may put files into the directory ``path`` or change the file ``path`` (another user owns it;
    others, or a group with other members, may write it, sticky bit or not), or None where only you may."""
    return _not_yours(os.stat(path))

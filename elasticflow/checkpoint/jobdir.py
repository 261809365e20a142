"""Which job folder under checkpoint.dir a run writes, and the lease that keeps that folder one run's.

A job folder (``checkpoint.dir/<job>_<stamp>/``) belongs to one run, and a run is its run directory
(``hydra.run.dir``, absolute): RUN_DIR/.elasticflow/checkpoint_job.json names the run's folder, and the
folder's ``.owner.json`` names the run (and the incarnation, by the run's checkpoint token) that writes it.

Liveness, without flock (often missing or broken on the shared filesystems multi-host jobs use):
every process of a run keeps a holder file, ``.lease-<token>-<host>-<pid>``, and touches it every
``BEAT_S`` seconds. A holder on this host (same boot, same pid namespace) is live while its process
runs, so a crashed run is seen dead at once; one on another host is live while its mtime is younger
than ``LEASE_S`` by the filesystem's own clock (a probe file's mtime), so no two hosts' clocks are
compared. ``.owner.json`` is created exclusively (``os.link``, atomic on local filesystems and NFS),
and taken over only from an incarnation with no live holder.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from ..errors import ElasticFlowError
from .._util.fileio import write_atomic
from .format import job_dirs

log = logging.getLogger("elasticflow")

JOB_RECORD = "checkpoint_job.json"  # in RUN_DIR/.elasticflow: the run's job folder
OWNER = ".owner.json"               # in the job folder: the run that writes it
# In the job folder, one heartbeat file per live process of that run: files, never directories, so
# nothing that tidies or lists a job folder's saves and temporary directories ever meets them.
HOLDER_RE = re.compile(r"^\.lease-(?P<token>[0-9A-Za-z]+)-(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)$")
BEAT_S = 3.0                        # one utime per process per beat: nothing next to a training step
# Another host's holder counts as live this long after its last beat: several beats, so an NFS client's
# attribute cache (re-checked on open, which is how holders are read) or a slow beat never looks dead --
# and short, because a restart after that host's crash (power-off: its holders stay) waits this long.
LEASE_S = 15.0
HINT_BUSY = "wait for that run to finish (or stop it), or give this run another checkpoint.dir or resume=none"

_ACTIVE: Set[Path] = set()  # holder files this process keeps: its own pid alone cannot say which are live


# ---------------------------------------------------------------- who is asking
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _started(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' if unknown): tells a reused pid apart."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[19] if ")" in stat else ""


def _me() -> Dict[str, Any]:
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
            "boot": _read("/proc/sys/kernel/random/boot_id"), "ns": ns}


def _same_machine(h: Dict[str, Any], me: Dict[str, Any]) -> bool:
    """True when ``h``'s pid can be checked from here: same host, boot and pid namespace."""
    return all(h.get(k) == me[k] for k in ("host", "boot", "ns"))


def _runs(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return not started or _started(pid) in ("", started)


def _fs_now(folder: Path) -> float:
    """The filesystem's clock, the one holders' mtimes come from: a probe file's mtime."""
    probe = folder / f".clock-{secrets.token_hex(4)}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        probe.unlink()


# ---------------------------------------------------------------- holders and owners
def _holders(job_dir: Path) -> List[Dict[str, Any]]:
    """Every holder file of ``job_dir``: its JSON plus ``path`` and ``mtime`` (read through open, which
    makes an NFS client revalidate the file's attributes)."""
    out = []
    for path in job_dir.iterdir() if job_dir.is_dir() else []:
        if not HOLDER_RE.match(path.name):
            continue  # a probe, a half-written holder, a moved-away owner record
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                mtime = os.fstat(fd).st_mtime
                h = json.loads(os.read(fd, 1 << 16) or b"{}")
            finally:
                os.close(fd)
        except (OSError, ValueError):
            continue  # removed meanwhile, or written by no elasticflow
        if isinstance(h, dict):
            out.append({**h, "path": path, "mtime": mtime})
    return out


class _Judge:
    """Decides which holders are live; reads the filesystem's clock only if a remote holder needs it."""

    def __init__(self, job_dir: Path):
        self.job_dir, self.me, self._now = job_dir, _me(), None

    def live(self, h: Dict[str, Any]) -> bool:
        if _same_machine(h, self.me):
            if h.get("pid") == self.me["pid"]:  # this process: an earlier trainer's lease, unless still held
                return Path(h["path"]) in _ACTIVE
            return _runs(int(h.get("pid", -1)), str(h.get("started", "")))
        if self._now is None:
            self._now = _fs_now(self.job_dir)
        return self._now - h["mtime"] < LEASE_S


def _owner_at(path: Path) -> Dict[str, Any]:
    """An owner record ({} if missing or not one elasticflow wrote)."""
    try:
        owner = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _owner(job_dir: Path) -> Optional[Dict[str, Any]]:
    return _owner_at(job_dir / OWNER) or None


def live_owner(job_dir: Path) -> Optional[Dict[str, Any]]:
    """The owner record of ``job_dir`` if a process of that run is still live, with ``holder`` (one of
    its live holders); None for a folder nobody writes now."""
    owner = _owner(job_dir)
    if owner is None:
        return None
    judge = _Judge(job_dir)
    for h in _holders(job_dir):
        if h.get("token") == owner.get("token") and judge.live(h):
            return {**owner, "holder": h, "checkable": _same_machine(h, judge.me)}
    return None


def _describe(owner: Dict[str, Any]) -> str:
    h = owner["holder"]
    return f"the run in {owner.get('run_dir')} (pid {h.get('pid')} on {h.get('host')})"


# ---------------------------------------------------------------- the lease
class Lease:
    """This process's hold on a job folder for the run incarnation ``token``; ``release`` (or exit) ends it."""

    def __init__(self, job_dir: Path, run_dir: Path, token: str):
        self.job_dir, self.run_dir, self.token = Path(job_dir), str(run_dir), token
        me = _me()
        host = re.sub(r"[^A-Za-z0-9_-]", "-", me["host"])[:64]
        tag = re.sub(r"[^0-9A-Za-z]", "", token)[:32] or "run"  # the file's name only; its JSON has the token
        self.path = self.job_dir / f".lease-{tag}-{host}-{me['pid']}"
        write_atomic(self.path, json.dumps({**me, "token": token, "run_dir": self.run_dir}))
        _ACTIVE.add(self.path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="elasticflow-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                log.warning("the lease file %s was removed: another run may now write this job folder "
                            "(it judged this run dead)", self.path)
                return
            except OSError:  # a filesystem hiccup: the next beat tries again, well inside LEASE_S
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove this process's holder file; idempotent. ``.owner.json`` stays:
        an owner without a live holder is taken over by the next run, with no window where two own it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        _ACTIVE.discard(self.path)
        try:
            self.path.unlink()
        except OSError:
            pass

    def claim(self, wait_s: float) -> None:
        """Become (or join) the folder's owner; waits up to ``wait_s`` for another host's lease of this
        same run directory to lapse (a restart elsewhere after a crash); raises if another run holds it."""
        deadline, waited = time.monotonic() + wait_s, False
        while True:
            if self._create_owner():
                return
            owner = _owner(self.job_dir)
            if owner is None:
                if (self.job_dir / OWNER).exists():
                    self._take_over({})  # not an owner record elasticflow wrote: nobody owns the folder
                else:
                    time.sleep(0.05)  # it is being taken over right now
                continue
            if owner.get("token") == self.token:
                return  # another process of this run created it first
            busy = live_owner(self.job_dir)
            if busy is None or busy.get("token") != owner.get("token"):
                self._take_over(owner)
                continue
            same_run = busy.get("run_dir") == self.run_dir
            if same_run and not busy["checkable"] and time.monotonic() < deadline:
                if not waited:
                    log.warning("job folder %s: waiting up to %.0f s for the lease of %s to lapse (a restart "
                                "after a crash there?)", self.job_dir, wait_s, _describe(busy))
                    waited = True
                time.sleep(min(BEAT_S / 2, max(0.1, deadline - time.monotonic())))
                continue
            what = "this run directory is already in use by" if same_run else "it is written by"
            raise ElasticFlowError(f"checkpoint job folder {self.job_dir} is taken: {what} {_describe(busy)}",
                                   HINT_BUSY if not same_run else
                                   "wait for that run to finish (or stop it), or pass another hydra.run.dir")

    def _create_owner(self) -> bool:
        tmp = self.path.with_name(self.path.name + ".owner")
        write_atomic(tmp, json.dumps({"token": self.token, "run_dir": self.run_dir, "since": time.time()}))
        try:
            os.link(tmp, self.job_dir / OWNER)  # exclusive: fails if the owner exists (atomic on NFS too)
            return True
        except FileExistsError:
            # NFS may answer a retransmitted LINK that did succeed with EEXIST: the link count says
            return os.stat(tmp).st_nlink == 2
        finally:
            tmp.unlink()

    def _take_over(self, stale: Dict[str, Any]) -> None:
        """Move a dead incarnation's owner record away; put it back if it changed under us."""
        moved = self.job_dir / f".owner.stale-{self.token}-{secrets.token_hex(4)}"
        try:
            os.rename(self.job_dir / OWNER, moved)
        except FileNotFoundError:
            return  # someone else moved it first
        try:
            if _owner_at(moved).get("token") != stale.get("token"):  # a new owner slipped in: restore it
                try:
                    os.link(moved, self.job_dir / OWNER)
                except FileExistsError:
                    pass
                return
            judge = _Judge(self.job_dir)
            for h in _holders(self.job_dir):  # the dead incarnation's litter
                if h.get("token") == stale.get("token") and not judge.live(h):
                    Path(h["path"]).unlink(missing_ok=True)
            log.info("job folder %s: taking over from the run in %s, which is no longer running", self.job_dir,
                     stale.get("run_dir"))
        finally:
            moved.unlink(missing_ok=True)


def hold(job_dir: Path, run_dir: Path, token: str, wait_s: float = LEASE_S + BEAT_S) -> Lease:
    """Hold ``job_dir`` for run ``run_dir`` (incarnation ``token``, the same on every process of the run).

    Raises ElasticFlowError (one line, with a hint) if another live run holds it.
    """
    lease = Lease(job_dir, run_dir, token)
    try:
        lease.claim(wait_s)
    except BaseException:
        lease.release()
        raise
    return lease


@atexit.register
def release_all() -> None:  # a clean exit (an error included) frees the folder at once; SIGKILL cannot
    for path in list(_ACTIVE):
        Path(path).unlink(missing_ok=True)
    _ACTIVE.clear()


# ---------------------------------------------------------------- choosing the folder
def recorded(state_dir: Path) -> Optional[str]:
    """The job folder name RUN_DIR/.elasticflow/checkpoint_job.json records, if any."""
    try:
        name = json.loads((Path(state_dir) / JOB_RECORD).read_text())["job"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def choose(checkpoint_dir: Path, job_name: str, state_dir: Path, run_dir: Path, fresh: bool,
           explicit: bool) -> Tuple[str, bool]:
    """This worker's proposal for the run's job folder, and whether it created it (a reservation).

    The run's recorded folder; else the newest ``<job_name>_*`` unless another live run writes it (a
    crashed run's folder is adopted: a restart with a new run directory resumes); else a new one.
    ``resume=none`` (``fresh``) always starts a new one.
    """
    run_dir = str(run_dir)
    if not fresh:
        # The run's recorded job, unless checkpoint.job_name now names another one (a renamed
        # model file is still the same run: the default name follows the file, the record does not).
        rec = recorded(state_dir)
        if rec and (checkpoint_dir / rec).is_dir() and (not explicit or rec.startswith(f"{job_name}_")):
            busy = live_owner(checkpoint_dir / rec)
            if busy is not None and busy.get("run_dir") != run_dir:
                raise ElasticFlowError(f"this run's checkpoint job folder {checkpoint_dir / rec} is written by "
                                       f"{_describe(busy)}", "wait for that run to finish (or stop it), or pass "
                                       "resume=none to start a new job folder")
            return rec, False
        existing = job_dirs(checkpoint_dir, job_name)
        if existing:
            busy = live_owner(existing[-1])
            if busy is None or busy.get("run_dir") == run_dir:
                return existing[-1].name, False
            log.warning("the newest job folder %s is written by %s; this run starts its own (resume=PATH "
                        "starts from one of that run's checkpoints)", existing[-1], _describe(busy))
    return _reserve(checkpoint_dir, job_name), True


def _reserve(checkpoint_dir: Path, job_name: str) -> str:
    """A new ``<job_name>_<stamp>[.n]`` folder, created exclusively: two runs started in the same second
    never share it."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, n = f"{job_name}_{stamp}", 0
    while True:
        try:
            (checkpoint_dir / name).mkdir()
            return name
        except FileExistsError:
            n += 1
            name = f"{job_name}_{stamp}.{n}"


def unreserve(job_dir: Path) -> None:
    """Remove a folder ``choose`` created that the run did not agree on (another worker's proposal won)."""
    try:
        job_dir.rmdir()  # only if still empty
    except OSError:
        pass


def record(state_dir: Path, checkpoint_dir: Path, name: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    # Every worker writes it at start-up and a restart reads it back: atomic, so never read torn.
    rec = {"job": name, "checkpoint_dir": str(checkpoint_dir)}  # checkpoint_dir: for people reading it
    write_atomic(state_dir / JOB_RECORD, json.dumps(rec))

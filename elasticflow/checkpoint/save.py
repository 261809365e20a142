"""Write sharded checkpoints: every rank its slice, in the background; rank 0 commits atomically.

One save, on each of the W ranks:
  1. training thread: snapshot this rank's slice of the flat state (numpy copies, ``snapshot.py``) --
     the only stall;
  2. writer thread: write ``shard-RRRRR-of-WWWWW.safetensors`` into the save's temporary directory,
     hashing each chunk (xxh3_64) just before it is written, then fsync;
  3. report (file, bytes, checksums) to rank 0 through the coordinator (the agent's store), and leave the report
     beside the shard: if the store fails, the save is committed from the files later (finish.py);
  4. rank 0 waits for all W reports (bounded by elastic.timeout_s), writes metadata.json and COMMIT,
     fsyncs and renames the directory to ``step_<N>``; then prunes to ``checkpoint.keep``.
A crash at any moment leaves the previous complete checkpoints as they were; a member that dies
mid-save means that save never commits, and its temporary directory is removed by a later commit.

Test hook (tests only, never set it in a real run): ``ELASTICFLOW_TEST_CKPT_KILL="PHASE:STEP[:RANK]"``
(comma-separated for several) SIGKILLs the writing process at that phase of the save of step STEP
(on rank RANK only, if given). PHASE is one of before_write, mid_write (half the shard's bytes
written), after_write (shard fsynced, not yet reported), before_commit (rank 0: metadata written,
no COMMIT yet), before_rename (rank 0: COMMIT written in the temporary directory).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import signal
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

import numpy as np

from .._util import affinity
from .._util.envnames import ENV_RUN_DIR_ID
from .._util.paths import HeldDirectory
from . import jobdir
from ..errors import ElasticFlowError
from .coordinator import (NOBODY_GONE, CollectTimeout, Coordinator, LocalCoordinator, Offline, StoreCoordinator, agree,
                          plain_name)
from .finish import basis, commit_own, metadata, write_report
from .format import (CHECKSUM, COMMIT, METADATA, Piece, Sharded, TensorSpec, _checkpoints_in, chunks, file_digest,
                     hashed, hasher, plan, plan_digest, shard_header, shard_name, specs_of, temp_dirs)
from .snapshot import SnapshotBuffer, layout

log = logging.getLogger("elasticflow")

KILL_ENV = "ELASTICFLOW_TEST_CKPT_KILL"
PHASES = ("before_write", "mid_write", "after_write", "before_commit", "before_rename")
NICE = 10         # the writer threads' niceness: under CPU contention, training runs first
HINT_DISK = "check free space and permissions of checkpoint.dir; the previous checkpoints are intact"


def _lower_priority() -> None:
    """Runs in each writer thread: on Linux a thread has its own nice value (setpriority on its TID), and
    its own CPU mask (started by the pinned training thread, it may still use every core)."""
    affinity.release()
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the process's priority
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(f, data) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        view = view[n:]


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        _write_all(f, data)
        os.fsync(f.fileno())


def _parse_kills(text: str) -> List[Tuple[str, int, Optional[int]]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or parts[0] not in PHASES:
            raise ElasticFlowError(f"{KILL_ENV}={text!r} is malformed",
                                   f"use PHASE:STEP[:RANK] with PHASE one of {', '.join(PHASES)}")
        out.append((parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None))
    return out


@dataclass
class _Job:
    """One save as this rank sees it."""
    name: str
    key: str                 # the coordinator key of this save
    tmp: Path
    final: Path
    step: int
    rank: int
    world: int
    specs: List[TensorSpec]
    pieces: List[Piece]      # what this rank writes, in file order
    views: List[np.ndarray]  # the snapshot of each piece (1-D)
    info: Dict[str, Any]
    digest: str
    started: float
    sharded: Optional[Sharded] = None
    offline: bool = False    # the agent's store cannot be reached: the reports are the files beside the shards
    gone: Callable[[], Collection[int]] = NOBODY_GONE  # ranks of the save that left the job (rank 0 stops waiting)


class Checkpointer:
    """Writes the checkpoints of one job directory; one in flight at a time.

    Args:
        job_dir: ``checkpoint.dir/<job_name>_<timestamp>``.
        keep: newest complete checkpoints retained (None: all).
        asynchronous: write in a background thread (``checkpoint.async_save``); False writes in ``save``.
        timeout_s: how long rank 0 waits for the other ranks' reports (``elastic.timeout_s``).
        coordinator: how ranks report to rank 0 when W > 1 (a ``StoreCoordinator``); W = 1 uses
            an in-memory one.
        token: names this run's temporary directories (the same on every rank of a run).

    Example (one process, W = 1):
        >>> ck = Checkpointer(Path("ckpts/job_20250101-000000"), keep=3)
        >>> ck.save("step_10", {"W": np.ones((4, 2), np.float32)}, {"step": 10, "cursor": {...}})
        >>> ck.wait()      # the committed path; raises if the background write failed
    """

    def __init__(self, job_dir: Path, keep: Optional[int] = None, asynchronous: bool = True,
                 timeout_s: float = 30.0, coordinator: Optional[Coordinator] = None, token: Optional[str] = None):
        self.job_dir = Path(job_dir)
        self.keep, self.asynchronous, self.timeout_s = keep, asynchronous, timeout_s
        self.protected: frozenset = frozenset()  # names pruning spares (the best-k checkpoints), set by their owner
        self.coordinator = coordinator
        self.local = LocalCoordinator()
        self.token = token or secrets.token_hex(4)
        self.kills = _parse_kills(os.environ.get(KILL_ENV, ""))
        self.last_path: Optional[Path] = None      # the newest checkpoint this process committed
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._snapshots = SnapshotBuffer()
        self._last_key: Optional[tuple] = None
        self._counts: Dict[tuple, int] = {}
        self.lease: Optional[jobdir.Lease] = None  # for_run's hold on job_dir; released by close()
        self.run_dir: Optional[HeldDirectory] = None  # for_run's: a save checks it still is where the run writes

    # ------------------------------------------------------------------ for a trainer's run
    @classmethod
    def for_run(cls, checkpoint_dir: Path, cfg: Any, run_dir: Path, membership: Any = None) -> "Checkpointer":
        """The checkpointer of a run: picks (or reuses) the job directory every worker agrees on.

        The job directory is reused across restarts of the same run: the name recorded in
        RUN_DIR/.elasticflow/checkpoint_job.json, else the newest ``<job_name>_*`` under
        ``checkpoint_dir`` that no other live run writes; ``resume=none`` starts a new job directory.
        The run holds it (``jobdir.hold``) until ``close``: ElasticFlowError if another live run does.
        """
        # The run directory as the launcher checked it ($ELASTICFLOW_RUN_DIR_ID, in a worker; as it is now, in a
        # process that trains alone): before its records are written below, and at each save (``save``).
        Path(run_dir).mkdir(parents=True, exist_ok=True)  # a trainer of your own loop makes it here
        held = HeldDirectory(run_dir, expect=os.environ.get(ENV_RUN_DIR_ID))
        c = cfg.checkpoint
        job_name = c.get("job_name") or Path(str(cfg.model)).stem
        state_dir = Path(run_dir) / ".elasticflow"
        store = getattr(membership, "store", None)
        candidate, reserved = jobdir.choose(Path(checkpoint_dir), job_name, state_dir, Path(run_dir).absolute(),
                                            fresh=str(cfg.resume) == "none", explicit=bool(c.get("job_name")))
        sealer = getattr(membership, "sealer", None)
        name = agree(store, "ckpt/job", candidate, sealer, valid=plain_name)
        token = agree(store, "ckpt/token", secrets.token_hex(4), sealer, valid=lambda t: t.isalnum() and len(t) <= 16)
        if reserved and name != candidate:  # another worker's proposal won: drop the folder this one made
            jobdir.unreserve(Path(checkpoint_dir) / candidate)
        job_dir = Path(checkpoint_dir) / name
        job_dir.mkdir(parents=True, exist_ok=True)
        # Before anything is read or written there: a second run must not prune, replace or tidy our saves.
        lease = jobdir.hold(job_dir, Path(run_dir).absolute(), token)
        jobdir.record(state_dir, Path(checkpoint_dir), name)
        timeout = float(cfg.elastic.timeout_s)
        coordinator = StoreCoordinator(membership.new_client, sealer) if membership is not None else None
        ck = cls(job_dir, keep=c.keep, asynchronous=bool(c.async_save), timeout_s=timeout,
                 coordinator=coordinator, token=token)
        ck.lease, ck.run_dir = lease, held
        weakref.finalize(ck, lease.release)  # a trainer dropped without close() (an error in a notebook)
        return ck

    # ------------------------------------------------------------------ the training thread
    def save(self, name: str, state: Dict[str, np.ndarray], info: Dict[str, Any], rank: int = 0, world: int = 1,
             generation: int = 0, wait: bool = False, copy: bool = True,
             sharded: Optional[Sharded] = None, offline: bool = False,
             gone: Callable[[], Collection[int]] = NOBODY_GONE) -> Optional[Path]:
        """Snapshot this rank's slice of ``state`` and write it (in the background unless ``wait``).

        Every rank of the save calls this at the same point with its replica of the state.
        Args:
            info: JSON-able step, epoch, cursor, counters... for metadata.json (rank 0's is used).
            generation: the membership generation: a save is identified by (generation, name, count).
            wait: return only once written (and, on rank 0, committed or given up).
            copy: False when ``state`` is already a private copy nobody changes (``engine.state()``);
                True (views of live tensors, ``engine.state(copy=False)``) copies this rank's slice.
            sharded: the tensors each rank holds only its own slice of (``Partial`` entries in ``state``,
                ``trainer.shard``): each rank writes that slice, nothing is gathered.
            offline: the agent's store cannot be reached: every rank writes its shard and its report beside it,
                and nothing commits here; ``elasticflow checkpoint commit`` or the next start does (finish.py).
            gone: the ranks of this save that left the job since (the agent declared them gone): rank 0 gives
                the save up once every rank still missing is one of them, not ``timeout_s`` later.
        Returns (rank 0) the checkpoint's path -- committed if ``wait``, else where it will be; else None.
        Note: waits for the previous save first, and raises its error if it failed. RunDirectoryMoved where the
        run directory's path leads elsewhere now (``paths.HeldDirectory``): nothing is written.
        """
        self.wait()
        if self.run_dir is not None:
            self.run_dir.check()
        step = int(info.get("step", 0))
        cursor = info.get("cursor") or {}
        key = (name, step, cursor.get("samples_seen"), generation)
        if key == self._last_key:
            # The same state saved twice at one point (Ctrl-C right after an interval save): written
            # already; the caller asks again because it is about to exit.
            return self.last_path if rank == 0 else None
        started = time.perf_counter()
        specs = specs_of(state)
        pieces = plan(specs, world, sharded)[rank]
        # A save the training thread waits for is written from the live state: no snapshot buffer (a copy of
        # this rank's slice) is needed while nothing changes it.
        background = self.asynchronous and not wait
        views = self._snapshots.take(state, pieces, copy and background)
        count = self._counts[(generation, name)] = self._counts.get((generation, name), 0) + 1
        save_id = f"{name}/g{generation}.{count}"
        job = _Job(name=name, key=f"ckpt/{self.token}/{save_id}", step=step, rank=rank, world=world,
                   tmp=self.job_dir / f".{name}.tmp-s{step}-{self.token}-g{generation}.{count}",
                   final=self.job_dir / name, specs=specs, pieces=pieces, views=views, info=dict(info),
                   digest=plan_digest(specs, world, sharded), started=started, sharded=sharded, offline=offline,
                   gone=gone)
        self._last_key = key
        # Always on the writer thread, even when waiting: the store client is bound to one thread.
        self._pending = self._writer().submit(self._run, job)
        if self.asynchronous and not wait:
            return job.final if rank == 0 else None
        return self.wait()

    def wait(self, timeout_s: Optional[float] = None) -> Optional[Path]:
        """Wait for the save in flight; its path on rank 0 (None if it did not commit).

        Raises ElasticFlowError if its write failed; ``TimeoutError`` after ``timeout_s`` (None: no bound).
        """
        pending = self._pending
        if pending is None:
            return None
        try:
            return pending.result(timeout=timeout_s)
        finally:  # kept until done: a second waiter (a SIGTERM's, worker.py) waits for the same save
            if pending.done() and self._pending is pending:
                self._pending = None

    def close(self) -> Optional[Path]:
        """Wait for the save in flight (returns what ``wait`` does), then stop the writer threads."""
        try:
            return self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = None
            if self.coordinator is not None:
                self.coordinator.close()
            if self.lease is not None:
                self.lease.release()

    def reserve(self, state: Dict[str, np.ndarray], rank: int = 0, world: int = 1,
                sharded: Optional[Sharded] = None) -> None:
        """Allocate the snapshot buffer for saves of ``state`` by ``rank`` of ``world``, in the background.

        Call it once at start-up: a fresh buffer's first-touch page faults cost more than the copy
        itself (0.4 s for 200 MB here, against 20 ms), and here the writer thread pays them while
        training runs. The next save waits for it. Note: a later change of world size resizes the
        buffer in that save.
        """
        self.wait()
        _, need = layout(plan(specs_of(state), world, sharded)[rank])
        self._pending = self._writer().submit(self._snapshots.reserve, need, True)

    def _writer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="elasticflow-ckpt", initializer=_lower_priority)
        return self._pool

    # ------------------------------------------------------------------ the writer thread
    def _run(self, job: _Job) -> Optional[Path]:
        coordinator = Offline() if job.offline and job.world > 1 else \
            self.coordinator if job.world > 1 and self.coordinator is not None else self.local
        try:
            report = self._write(job)
        except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then raised at the next save
            self._report(coordinator, job, {"ok": False, "rank": job.rank, "error": f"{type(exc).__name__}: {exc}"})
            raise ElasticFlowError(f"writing checkpoint {job.name} (rank {job.rank} of {job.world}) into "
                                   f"'{job.tmp}' failed: {exc}", HINT_DISK) from exc
        if not self._report(coordinator, job, report):
            return self._from_files(job, "") if job.rank == 0 else None
        if job.rank != 0:
            return None
        try:
            return self._commit(job, coordinator)
        except OSError as exc:
            raise ElasticFlowError(f"committing checkpoint {job.name} in '{self.job_dir}' failed: {exc}",
                                   HINT_DISK) from exc

    def _kill_at(self, phase: str, job: _Job) -> None:
        for p, step, rank in self.kills:
            if p == phase and step == job.step and rank in (None, job.rank):
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    def _write(self, job: _Job) -> Dict[str, Any]:
        self._kill_at("before_write", job)
        job.tmp.mkdir(parents=True, exist_ok=True)
        fname = shard_name(job.rank, job.world)
        path = job.tmp / fname
        header = shard_header(job.pieces, {s.name: s for s in job.specs}, job.rank, job.world)
        total = sum(p.nbytes for p in job.pieces)
        written, halfway = 0, False
        piece_sums = []  # one per piece: a reader checks what it reads, whole files or not
        with open(path, "wb", buffering=0) as f:
            _write_all(f, header)
            for view in job.views:
                piece = hasher(CHECKSUM)
                for chunk in hashed(piece, chunks(memoryview(view).cast("B"))):  # hashed just before written
                    _write_all(f, chunk)
                    written += len(chunk)
                    if not halfway and 2 * written >= total:
                        halfway = True
                        self._kill_at("mid_write", job)
                piece_sums.append(piece.hexdigest())
            os.fsync(f.fileno())
        nbytes = len(header) + total
        if path.stat().st_size != nbytes:
            raise OSError(f"{path} has {path.stat().st_size} bytes after writing {nbytes}")
        job.views = []  # the snapshot is on disk: let the buffer go back to the next save
        report = {"ok": True, "rank": job.rank, "host": socket.gethostname(), "file": fname, "bytes": nbytes,
                  "checksum": file_digest(CHECKSUM, header, piece_sums), "pieces": piece_sums, "plan": job.digest}
        if job.world > 1:  # the commit needs the store: the report on disk too, to finish it from if that fails
            write_report(job.tmp, job.key, job.rank, job.world, report,
                         basis(job.specs, job.sharded, job.info, CHECKSUM) if job.rank == 0 else None)
        self._kill_at("after_write", job)
        return report

    def _report(self, coordinator: Coordinator, job: _Job, report: Dict[str, Any]) -> bool:
        try:
            coordinator.report(job.key, job.rank, report)
            return True
        except Exception as exc:  # noqa: BLE001 - the agent's store is gone: no save can commit
            log.warning("checkpoint %s not committed: rank %d could not report its shard (%s)",
                        job.name, job.rank, str(exc).splitlines()[0][:200])
            return False

    def _commit(self, job: _Job, coordinator: Coordinator) -> Optional[Path]:
        try:
            reports = coordinator.collect(job.key, job.world, self.timeout_s, gone=job.gone)
        except CollectTimeout as exc:
            log.warning("checkpoint %s not committed: %s (a member died or stalled); training goes on, "
                        "the previous checkpoint stays the newest", job.name, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the store is gone
            return self._from_files(job, f"collecting the shard reports failed ({str(exc).splitlines()[0][:200]})")
        failed = [r for r in reports if not r.get("ok")]
        if failed:
            log.warning("checkpoint %s not committed: %s", job.name,
                        "; ".join(f"rank {r['rank']}: {r.get('error')}" for r in failed))
            return None
        if any(r["plan"] != job.digest for r in reports):
            raise ElasticFlowError(f"checkpoint {job.name}: the ranks' states differ in names, dtypes or shapes "
                                   f"(plans {sorted({r['plan'] for r in reports})})",
                                   "this is a bug in the replicas; report it with RUN_DIR/logs/")
        for r in reports:  # rank 0 must see every shard where its writer put it: checkpoint.dir is shared
            shard = job.tmp / r["file"]
            if not shard.is_file() or shard.stat().st_size != r["bytes"]:
                raise ElasticFlowError(
                    f"checkpoint {job.name}: rank {r['rank']} on {r.get('host', '?')} wrote {shard}, which rank 0 on "
                    f"{socket.gethostname()} cannot see: checkpoint.dir is not on a filesystem every host shares",
                    "put checkpoint.dir (and hydra.run.dir) on a shared filesystem mounted at the same path on every "
                    "host")
        meta = metadata(job.specs, job.world, job.sharded, job.info, reports, CHECKSUM, job.name)
        _write_file(job.tmp / METADATA, json.dumps(meta, indent=1, sort_keys=True).encode())
        self._kill_at("before_commit", job)
        # No fsync of its own: a COMMIT counts by existing, and fsync(tmp) below makes its entry durable.
        (job.tmp / COMMIT).write_bytes(b"ok\n")
        for stray in job.tmp.iterdir():  # files of an earlier attempt at this save (another world size)
            if stray.name not in meta["files"] and stray.name not in (METADATA, COMMIT):
                stray.unlink()
        _fsync_dir(job.tmp)
        self._kill_at("before_rename", job)
        old = None
        if job.final.exists():  # the same name written twice (a resume from an earlier checkpoint)
            old = self.job_dir / f".{job.name}.old-{self.token}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(job.final, old)
        os.replace(job.tmp, job.final)
        _fsync_dir(self.job_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.last_path = job.final
        self._tidy(job)
        size = sum(f["bytes"] for f in meta["files"].values())
        log.info("checkpoint %s written (%d shard%s, %.1f MiB, %.2f s)", job.final, job.world,
                 "" if job.world == 1 else "s", size / 2**20, time.perf_counter() - job.started)
        return job.final

    def _from_files(self, job: _Job, why: str) -> Optional[Path]:
        """Rank 0, a save whose commit needed the store, which failed (``why``, '' where it was rank 0's own report):
        committed from the files every rank leaves beside its shard once all are there (finish.commit_own, waiting
        up to ``timeout_s`` for the others), so a store lost at the end loses no trained state; else the files are
        left, with the command that commits them."""
        final = commit_own(job.tmp, self.job_dir, self.token, self.timeout_s)
        if final is not None:
            log.warning("checkpoint %s committed from its %d shard files: the agent's store could not be reached%s",
                        final, job.world, f" ({why})" if why else "")
            self.last_path = final
            return final
        where = self.lease.run_dir if self.lease is not None else str(self.job_dir)
        log.warning("checkpoint %s not committed: %severy worker's shard and report are left in %s: once all %d are, "
                    "`elasticflow checkpoint commit %s` commits it from them, and so does the next start "
                    "(resume=auto)", job.name, f"{why}; " if why else "", job.tmp.name, job.world, where)
        return None

    def _tidy(self, job: _Job) -> None:
        """After a commit: drop temporary directories no rank can still be writing, and old checkpoints.

        Every rank finished its saves of earlier steps before reporting this one, so a temporary
        directory of an earlier step (or of an earlier run) is abandoned.
        """
        for path, step, token in temp_dirs(self.job_dir):
            if path != job.tmp and (token != self.token or step < job.step):
                shutil.rmtree(path, ignore_errors=True)
        for old in self.job_dir.glob(".*.old-*"):  # a replaced checkpoint whose removal was interrupted
            shutil.rmtree(old, ignore_errors=True)
        if self.keep:  # the newest `keep`, and the protected ones beside them
            for old in _checkpoints_in(self.job_dir)[:-self.keep]:
                # Never the save just committed, even if older steps sort after it (a resume=PATH from an
                # earlier step of this folder): pruning it would lose the run's newest state at once.
                if old != job.final and old.name not in self.protected:
                    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- one-call API
def save(directory: str | Path, name: str, tensors: Dict[str, np.ndarray], info: Dict[str, Any],
         keep: Optional[int] = None) -> Optional[Path]:
    """Write ``tensors`` and ``info`` as checkpoint ``directory/name`` (one writer, synchronous).

    Example:
        >>> save("ckpts/myjob_20250101-000000", "step_10", {"W": w}, {"step": 10, "cursor": {"samples_seen": 640}})
    """
    ck = Checkpointer(Path(directory), keep=keep, asynchronous=False)
    try:
        return ck.save(name, tensors, info, wait=True)
    finally:
        ck.close()

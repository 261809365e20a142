"""Finishing a save from its files: the commit that the agent's store could not coordinate.

A save of W > 1 workers commits when rank 0 holds every rank's report, which travel through the agent's store
(save.py). Each rank also leaves its report beside its shard, in the save's temporary directory, as
``report-RRRRR-of-WWWWW.json``; rank 0's carries what the metadata needs besides the reports (the run's progress,
the tensors and how they are split). So when the store cannot be reached at the end (the agent's host lost, its
door held shut), every rank still writes its shard and report, and the save is finished from them: by
``elasticflow checkpoint commit RUN_DIR`` (``commit_run``), or by the next start with ``resume=auto``
(``finish_pending``).

Only a whole save is committed: every rank's report and shard present, each shard's header the one its plan
makes, its bytes hashing to the checksums its writer reported, and every rank's plan the one rank 0's tensors
make. Anything less is refused in one line naming what is missing or wrong; a partial set is never committed.
Only a save newer than the job's newest complete checkpoint is considered.

Note: whoever may write the checkpoint folder may write these files too (as it may write a checkpoint):
the checks catch a lost or torn file, not a forger (docs/security.md).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .._util import untrusted
from .._util.fileio import fsync_dir, write_atomic
from ..errors import ElasticFlowError
from .format import (COMMIT, FORMAT_VERSION, METADATA, NAME_RE, TMP_RE, CorruptCheckpoint, Sharded,
                     TensorSpec, _checkpoints_in, file_digest, hashed, hasher, job_dirs, plan, plan_digest,
                     read_chunks, read_metadata, shard_header, shard_name)
from .validate import check_metadata

log = logging.getLogger("elasticflow")

REPORT_RE = re.compile(r"^report-(?P<rank>\d{5,})-of-(?P<world>\d{5,})\.json$")
CLAIMED_RE = re.compile(r"^\.finishing-(?P<claim>[0-9A-Za-z]+)-(?P<orig>\..+)$")  # a save being finished
REFUSED = "REFUSED"       # in a save's directory: why its files cannot be committed (not tried again)
MAX_REPORT = 64 << 20     # rank 0's report lists every tensor: a few MB for the largest models
VERIFY_BPS = 100e6        # bytes a second a sibling's check of the shards is given, on top of the timeout
HINT = "resume=auto resumes from the newest committed checkpoint; the missing ranks' shards never reached the disk"


def report_name(rank: int, world: int) -> str:
    return f"report-{rank:05d}-of-{world:05d}.json"


# ---------------------------------------------------------------- what the writers leave
def write_report(tmp: Path, save: str, rank: int, world: int, report: Dict[str, Any],
                 basis: Optional[Dict[str, Any]] = None) -> None:
    """Leave rank ``rank``'s ``report`` of save ``save`` beside its shard (rank 0: with ``basis``)."""
    record = {"format_version": FORMAT_VERSION, "save": save, "rank": rank, "world": world, "report": report}
    if basis is not None:
        record["basis"] = basis
    write_atomic(tmp / report_name(rank, world), json.dumps(record))


def basis(specs: List[TensorSpec], sharded: Optional[Sharded], info: Dict[str, Any], checksum: str) -> Dict[str, Any]:
    """What rank 0 knows of a save besides the reports: enough to write its metadata."""
    return {"info": info, "checksum": checksum, "specs": [[s.name, s.dtype, list(s.shape)] for s in specs],
            "sharded": _sharded_record(sharded)}


def _sharded_record(s: Optional[Sharded]) -> Optional[Dict[str, Any]]:
    return None if s is None else {"n": s.n, "offsets": s.offsets, "owners": None if s.owners is None else
                                   list(s.owners), "frozen": _sharded_record(s.frozen)}


def _sharded_of(rec: Any) -> Optional[Sharded]:
    if rec is None:
        return None
    owners = rec["owners"]
    return Sharded(int(rec["n"]), {str(k): int(v) for k, v in rec["offsets"].items()},
                   None if owners is None else tuple(int(o) for o in owners), _sharded_of(rec["frozen"]))


def metadata(specs: List[TensorSpec], world: int, sharded: Optional[Sharded], info: Dict[str, Any],
             reports: List[Dict[str, Any]], checksum: str, name: str) -> Dict[str, Any]:
    """metadata.json of save ``name`` from its tensors, rank 0's ``info`` and every rank's report."""
    tensors = {s.name: {"dtype": s.dtype, "shape": list(s.shape), "shards": []} for s in specs}
    files = {}
    for rank, (pieces, rep) in enumerate(zip(plan(specs, world, sharded), reports)):
        if len(rep["pieces"]) != len(pieces):
            raise ElasticFlowError(f"checkpoint {name}: rank {rank} wrote {len(rep['pieces'])} pieces, "
                                   f"its plan has {len(pieces)}", "this is a bug; report it")
        files[rep["file"]] = {"rank": rank, "bytes": rep["bytes"], "checksum": rep["checksum"],
                              "tensors": len(pieces), "data_bytes": sum(p.nbytes for p in pieces)}
        for p, digest in zip(pieces, rep["pieces"]):
            tensors[p.name]["shards"].append({"file": rep["file"], "start": p.start, "end": p.end,
                                              "checksum": digest})
    return {"format_version": FORMAT_VERSION, "world_size": world, **info, "writers": world, "tensors": tensors,
            "files": files, "checksum": checksum,
            "layout": "flat state, sorted names, split by bytes over the writers"}


# ---------------------------------------------------------------- what is pending
@dataclass
class Pending:
    """A save's directory that never committed: ``problem`` says why it cannot be (None: all there, by name and
    size; the bytes are checked when it is committed)."""
    path: Path
    original: str            # its temporary directory's name (also while claimed)
    name: str                # step_N / epoch_N
    order: Tuple[int, int]   # (step, samples seen): how it sorts among the job's checkpoints
    claim: Optional[str]     # the run (checkpoint token) finishing it now, if any
    mtime: float = 0.0
    world: int = 0
    records: Optional[Dict[int, Dict[str, Any]]] = None
    problem: Optional[str] = None


def _load(path: Path) -> Any:
    with open(path, "rb") as f:
        return untrusted.loads(f.read(MAX_REPORT + 1), max_bytes=MAX_REPORT)


def _look(path: Path, original: str, claim: Optional[str]) -> Optional[Pending]:
    m = TMP_RE.match(original)
    if m is None or not path.is_dir() or path.is_symlink():
        return None
    p = Pending(path, original, m.group("name"), (int(m.group("step")), -1), claim, path.stat().st_mtime)
    if (path / REFUSED).is_file():
        p.problem = "refused before: " + (path / REFUSED).read_text(errors="replace").strip()[:400]
        return p
    by_world: Dict[int, Dict[int, Any]] = {}
    for child in path.iterdir():
        r = REPORT_RE.match(child.name)
        if r is not None:
            try:
                record = _load(child)
            except (OSError, ValueError):
                record = None  # unreadable: its rank counts as missing
            by_world.setdefault(int(r.group("world")), {})[int(r.group("rank"))] = record
    if not by_world:
        p.problem = "no worker's report of it is on disk (a save that died before any shard was written)"
        return p
    # One save's directory holds one world's files; another's are an earlier attempt's (a regroup): the
    # world rank 0 reported, else the one most ranks did.
    p.world = max(by_world, key=lambda w: (isinstance(by_world[w].get(0), dict), len(by_world[w]), w))
    p.records = {r: rec for r, rec in by_world[p.world].items() if isinstance(rec, dict)}
    zero = p.records.get(0, {}).get("basis")
    if isinstance(zero, dict) and isinstance(zero.get("info"), dict):
        info = zero["info"]
        cursor = info.get("cursor") if isinstance(info.get("cursor"), dict) else {}
        if type(info.get("step")) is int and type(cursor.get("samples_seen")) is int:
            p.order = (info["step"], cursor["samples_seen"])
    missing = []
    for r in range(p.world):
        report = p.records.get(r, {}).get("report")
        shard = path / shard_name(r, p.world)
        if not isinstance(report, dict) or not shard.is_file() or shard.stat().st_size != report.get("bytes"):
            missing.append(r)
    if missing:
        p.problem = (f"the shard{'s' if len(missing) > 1 else ''} of rank{'s' if len(missing) > 1 else ''} "
                     f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''} of {p.world} "
                     f"{'are' if len(missing) > 1 else 'is'} missing or incomplete "
                     f"({', '.join(shard_name(r, p.world) for r in missing[:3])}{' ...' if len(missing) > 3 else ''})")
    return p


def survey(job_dir: Path, running: Optional[str] = None) -> List[Pending]:
    """The saves of ``job_dir`` that never committed and are newer than its newest complete checkpoint, newest
    first. ``running``: the checkpoint token of the run now writing the folder, whose own saves may be in flight
    (a worker that joins a running job resumes too): never taken."""
    job_dir = Path(job_dir)
    if not job_dir.is_dir():
        return []
    done = _checkpoints_in(job_dir)
    newest = (-1, -1)
    if done:
        try:
            meta = read_metadata(done[-1])
            newest = (int(meta["step"]), int(meta["cursor"]["samples_seen"]))
        except (ElasticFlowError, KeyError, TypeError, ValueError):
            pass
    found = []
    for child in job_dir.iterdir():
        m = CLAIMED_RE.match(child.name)
        original, claim = (m.group("orig"), m.group("claim")) if m else (child.name, None)
        t = TMP_RE.match(original)
        if t is None or (running is not None and t.group("token") == running and claim is None):
            continue
        try:
            p = _look(child, original, claim)
        except FileNotFoundError:  # taken (renamed) by another process while we looked
            continue
        if p is not None and p.order > newest:  # (step, -1) when rank 0's report is missing: by step alone
            found.append(p)
    return sorted(found, key=lambda p: (p.order, p.mtime), reverse=True)


# ---------------------------------------------------------------- committing one
def _shard_digests(path: Path, header: bytes, pieces: list, algorithm: str) -> List[str]:
    """The checksum of each piece of shard ``path``, whose header must be ``header`` byte for byte."""
    with open(path, "rb", buffering=0) as f:
        if f.read(len(header)) != header:
            raise CorruptCheckpoint(f"checkpoint shard '{path}' is corrupt: its header is not the one its plan makes",
                                    HINT)
        digests = []
        for p in pieces:
            h = hasher(algorithm)
            if sum(len(c) for c in hashed(h, read_chunks(f, p.nbytes))) != p.nbytes:
                raise CorruptCheckpoint(f"checkpoint shard '{path}' is truncated", HINT)
            digests.append(h.hexdigest())
        if f.read(1):
            raise CorruptCheckpoint(f"checkpoint shard '{path}' is corrupt: bytes past its last piece", HINT)
    return digests


def verify(p: Pending) -> Dict[str, Any]:
    """The metadata of pending save ``p``, once every shard is checked against its writer's report; else
    CorruptCheckpoint in one line (what is missing, or which file and what is wrong with it)."""
    if p.problem:
        partial = "; a partial set of shards is never committed" if p.world else ""
        raise CorruptCheckpoint(f"checkpoint {p.name} ({p.path}) cannot be committed: {p.problem}{partial}", HINT)
    records = p.records or {}
    try:
        zero = records[0]["basis"]
        specs = [TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in zero["specs"]]
        sharded, info, algorithm = _sharded_of(zero["sharded"]), dict(zero["info"]), str(zero["checksum"])
        pieces = plan(specs, p.world, sharded)
        digest = plan_digest(specs, p.world, sharded)
        reports = [records[r]["report"] for r in range(p.world)]
        saves = {records[r].get("save") for r in range(p.world)}
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise CorruptCheckpoint(f"checkpoint {p.name} ({p.path}) cannot be committed: rank 0's report is not one a "
                                f"writer makes ({type(exc).__name__}: {str(exc)[:120]})", HINT) from None
    if len(saves) != 1:
        raise CorruptCheckpoint(f"checkpoint {p.name} ({p.path}) cannot be committed: its reports are of "
                                f"{len(saves)} different saves", HINT)
    by_name = {s.name: s for s in specs}
    for r, rep in enumerate(reports):
        shard = p.path / shard_name(r, p.world)
        if not (isinstance(rep, dict) and rep.get("ok") is True and rep.get("plan") == digest
                and rep.get("file") == shard.name and isinstance(rep.get("pieces"), list)):
            raise CorruptCheckpoint(f"checkpoint {p.name} ({p.path}) cannot be committed: rank {r}'s report does not "
                                    f"fit rank 0's plan of the tensors", HINT)
        digests = _shard_digests(shard, shard_header(pieces[r], by_name, r, p.world), pieces[r], algorithm)
        if digests != rep["pieces"] or rep.get("checksum") != file_digest(
                algorithm, shard_header(pieces[r], by_name, r, p.world), digests):
            raise CorruptCheckpoint(f"checkpoint shard '{shard}' is corrupt: its bytes do not hash to the checksums "
                                    "its writer reported", HINT)
    meta = metadata(specs, p.world, sharded, info, reports, algorithm, p.name)
    check_metadata(p.path, meta)
    return meta


def commit(p: Pending, job_dir: Path) -> Path:
    """Check pending save ``p`` (``verify``) and commit it in its place, ``job_dir/<name>``; its path."""
    meta = verify(p)
    write_atomic(p.path / METADATA, json.dumps(meta, indent=1, sort_keys=True))
    (p.path / COMMIT).write_bytes(b"ok\n")
    for stray in p.path.iterdir():  # the reports, and files of an earlier attempt at this save
        if stray.name not in meta["files"] and stray.name not in (METADATA, COMMIT):
            shutil.rmtree(stray) if stray.is_dir() and not stray.is_symlink() else stray.unlink()
    fsync_dir(p.path)
    final = Path(job_dir) / p.name
    if final.exists():  # an older save of the same name (it sorts before this one: survey)
        old = Path(job_dir) / f".{p.name}.old-finish-{secrets.token_hex(4)}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(p.path, final)
    fsync_dir(Path(job_dir))
    return final


def _claim(p: Pending, job_dir: Path, token: str) -> Optional[Pending]:
    """Take ``p`` to finish it (a rename: one process of a run wins); None if another took it first."""
    claimed = Path(job_dir) / f".finishing-{token}-{p.original}"
    try:
        os.rename(p.path, claimed)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
            return None
        raise
    return replace(p, path=claimed, claim=token)


def _give_back(p: Pending, job_dir: Path, why: str) -> None:
    """A claimed save that cannot be committed: back under its own name, marked so nobody checks it again."""
    try:
        (p.path / REFUSED).write_text(why + "\n")
        os.rename(p.path, Path(job_dir) / p.original)
    except OSError:
        pass


def _wait_gone(path: Path, deadline: float) -> bool:
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------- by the run itself, at a start, and by command
def commit_own(tmp: Path, job_dir: Path, token: str, wait_s: float) -> Optional[Path]:
    """Rank 0 of a run whose store failed during save ``tmp`` (incarnation ``token``): once every rank's report
    and shard are beside it (waiting up to ``wait_s``: the others write theirs at the same time), commit it from
    the files, as ``elasticflow checkpoint commit`` would. Returns its path; None where a rank's files do not come
    (a rank died writing: the CLI or the next start finishes it once they are there) or the check refuses them."""
    deadline, pause = time.monotonic() + wait_s, 0.05
    while True:
        try:
            p = _look(Path(tmp), Path(tmp).name, None)
        except FileNotFoundError:
            return None
        if p is not None and p.problem is None:
            break
        if p is None or time.monotonic() > deadline:
            return None
        # Each look reads every rank's report: the pause grows (to 1 s) so that a long wait costs few reads
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, 1.0)
    mine = _claim(p, job_dir, token)
    if mine is None:
        return None
    try:
        return commit(mine, job_dir)
    except ElasticFlowError as exc:
        _give_back(mine, job_dir, exc.message)
        log.warning("%s", exc.message)
        return None


def finish_pending(job_dir: Path, token: str, wait_s: float) -> Optional[Path]:
    """At a start with ``resume=auto``, on every worker of the run (incarnation ``token``): commit the newest save
    of ``job_dir`` whose shards are all on disk but never committed. One worker does it; the others wait for it
    (bounded: ``wait_s`` and the time to read the shards). Returns what it committed; logs what it could not."""
    deadline = time.monotonic() + wait_s
    tried = set()
    while True:
        pending = [p for p in survey(job_dir, running=token) if p.original not in tried]
        if not pending:
            return None
        p = pending[0]
        tried.add(p.original)
        if p.claim == token:  # a worker of this run is finishing it: wait, then look again
            if not _wait_gone(p.path, deadline + _bytes(p) / VERIFY_BPS):
                log.warning("checkpoint %s is still being committed from its files by another worker; going on "
                            "without it", p.name)
                return None
            continue
        if p.problem:
            if p.world:  # not a save that died before any report (or one of a single process, which has none)
                log.warning("checkpoint %s of an earlier run was not committed and cannot be: %s", p.name, p.problem)
            continue
        mine = _claim(p, job_dir, token)
        if mine is None:
            tried.discard(p.original)  # taken by a worker of this run a moment ago: wait for it, above
            continue
        try:
            final = commit(mine, job_dir)
        except ElasticFlowError as exc:
            _give_back(mine, job_dir, exc.message)
            log.warning("%s", exc.message)
            continue
        log.warning("checkpoint %s committed from its %d shard files: the save's commit had not reached the disk "
                    "(the agent's store could not be reached)", final, mine.world)
        return final


def _bytes(p: Pending) -> int:
    try:
        return sum(f.stat().st_size for f in p.path.iterdir())
    except OSError:
        return 0


def job_folder(path: Path) -> Tuple[Path, Path]:
    """(job folder, run directory) for ``elasticflow checkpoint commit PATH``: PATH is a run directory (its
    recorded job folder, else the newest under its checkpoints/), a job folder, or a checkpoint.dir."""
    from .jobdir import JOB_RECORD

    path = Path(path).absolute()
    if not path.is_dir():
        raise ElasticFlowError(f"{path} is not a directory", "pass the run directory (hydra.run.dir) of the run whose "
                               "final save did not commit")
    try:
        rec = untrusted.loads((path / ".elasticflow" / JOB_RECORD).read_bytes())
        job = Path(str(rec["checkpoint_dir"])) / str(rec["job"])
        if job.is_dir() and NAME_RE.match(job.name) is None:
            return job, path
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if any(TMP_RE.match(c.name) or CLAIMED_RE.match(c.name) or NAME_RE.match(c.name) for c in path.iterdir()):
        return path, path
    for base in (path / "checkpoints", path):
        jobs = job_dirs(base)
        if jobs:
            return jobs[-1], path
    raise ElasticFlowError(f"no checkpoint job folder in {path}", "pass the run directory (hydra.run.dir), or the "
                           "job folder checkpoint.dir/<job>_<stamp>")


def commit_run(path: Path) -> str:
    """``elasticflow checkpoint commit PATH``: commit the newest save of the run at PATH whose commit did not reach
    the disk, from its shard files. One line on what it did; ElasticFlowError (one line, which shards are missing)
    if it cannot; refused while a run writes the folder."""
    from . import jobdir

    job_dir, run_dir = job_folder(path)
    token = "commit" + secrets.token_hex(4)
    lease = jobdir.hold(job_dir, run_dir, token, wait_s=0)  # refuses while a run is live there
    try:
        pending = survey(job_dir)
        if not pending:
            newest = _checkpoints_in(job_dir)
            return (f"nothing to commit in {job_dir}: no save newer than its newest checkpoint "
                    f"({newest[-1].name if newest else 'none'}) is waiting for its commit")
        refusals = []
        for p in pending:
            if p.problem is None:
                mine = _claim(p, job_dir, token)
                if mine is None:
                    continue
                try:
                    final = commit(mine, job_dir)
                except ElasticFlowError as exc:
                    _give_back(mine, job_dir, exc.message)
                    refusals.append(exc)
                    continue
                newer = "" if not refusals else f"; a newer one could not be: {refusals[0].message}"
                return f"committed {final} from its {mine.world} shard files (step {mine.order[0]}){newer}"
            try:
                verify(p)
            except ElasticFlowError as exc:
                refusals.append(exc)
        raise refusals[0] if refusals else ElasticFlowError(f"nothing could be committed in {job_dir}", HINT)
    finally:
        lease.release()

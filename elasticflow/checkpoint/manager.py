"""The trainer's side of checkpoints: when to save, what a save records, resuming, and refusing a
checkpoint that does not fit the model.

The manager reaches the training state only through two accessors (as the replica does), so the trainer
never hands it ``self``: ``state_dict() -> (arrays, progress)`` and ``load_state_dict(arrays, progress)``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Set, Tuple

from ..errors import CheckpointMismatch, ElasticFlowError
from .finish import finish_pending
from .format import (HINT_FALLBACK, METADATA, CorruptCheckpoint, complete_checkpoints, config_hash, latest,
                     read_metadata, resolve)
from .load import compare_names, load_with_metadata
from .save import Checkpointer
from .validate import EXTRA, check_fit, check_progress

log = logging.getLogger("elasticflow")


class CheckpointInterval:
    """When to save: every ``steps`` optimizer steps or every ``epochs`` epochs (not both).

    Example:
        >>> CheckpointInterval(steps=100).should_save(current_step=200)
        True
    """

    def __init__(self, steps: Optional[int] = None, epochs: Optional[int] = None):
        if steps and epochs:
            raise ValueError("Only one of 'steps' or 'epochs' should be set.")
        self.steps = steps
        self.epochs = epochs

    def should_save(self, current_step: Optional[int] = None, current_epoch: Optional[int] = None) -> bool:
        if self.steps and current_step and current_step % self.steps == 0:
            return True
        if self.epochs and current_epoch and current_epoch % self.epochs == 0:
            return True
        return False


def _gone(replica: Any) -> Callable[[], Set[int]]:
    """The ranks of a save made now that have left the job since: the worker ids of the save's generation, in
    rank order, against those the agent declared gone (``Membership.departed``, a set its poll thread fills)."""
    membership = getattr(replica, "membership", None)
    departed = getattr(membership, "departed", None)
    if departed is None:  # one process: nobody leaves
        return set
    ids = list(membership.members)
    return lambda: {r for r, w in enumerate(ids) if w in departed}


def file_hash(path: Any) -> Optional[str]:
    """The first 16 hex digits of the sha256 of the file at ``path``; None when it cannot be read."""
    try:
        return hashlib.sha256(Path(str(path)).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


class CheckpointManager:
    """Saves and resumes one run's checkpoints.

    Args:
        checkpointer: the job directory's writer (``Checkpointer.for_run``).
        cfg: the run's config (its seed, batch size and hash are recorded; ``resume`` is read).
        optimizer: the optimizer's name (a checkpoint with another optimizer's slots is refused).
        backend: the backend's name (recorded for people; checkpoints load on either backend).
        state_dict / load_state_dict: the training state's accessors.
        epoch_samples: the samples in an epoch of the run's data: a checkpoint whose cursor lies past it is
            refused (None: not checked).
    """

    def __init__(self, checkpointer: Checkpointer, cfg: Any, optimizer: str, backend: str,
                 state_dict: Callable[[], Tuple[Dict[str, Any], Dict[str, Any]]],
                 load_state_dict: Callable[[Dict[str, Any], Dict[str, Any]], None],
                 epoch_samples: Optional[int] = None):
        self.checkpointer = checkpointer
        self.state_dict, self.load_state_dict = state_dict, load_state_dict
        ck = cfg.checkpoint
        # Saves in the background while training runs (by interval, or best-k at evaluations): only they
        # need a snapshot buffer kept from save to save (``reserve``).
        self.periodic = bool(ck.async_save and (ck.interval.steps or ck.interval.epochs or ck.monitor))
        self.resume_mode = str(cfg.resume)
        self.optimizer = optimizer
        self.model_file = Path(str(cfg.model)).name
        self.recorded = {"backend": backend, "optimizer": optimizer, "seed": cfg.seed,
                         "global_batch_size": cfg.trainer.global_batch_size, "config_hash": config_hash(cfg),
                         "model_file_sha256": file_hash(cfg.model)}
        self.epoch_samples = epoch_samples
        self.attempted_step: Optional[int] = None  # the step of this run's newest save (committed or not)

    @property
    def job_dir(self) -> Path:
        return self.checkpointer.job_dir

    def reserve(self, rank: int, world: int, sharded: Any = None) -> None:
        """Allocate the snapshot buffer for this rank's slice now, off the training thread, where saves will
        run in the background. Not otherwise: the buffer (this rank's slice of the parameters and the
        optimizer's slots) would stay resident for the whole run to serve only the last save, which waits
        anyway -- at 154M parameters with Adam on 4 workers, 441 MiB of a trainer.shard=parameters
        worker's 1.5 GiB."""
        if self.periodic:
            self.checkpointer.reserve(self.state_dict()[0], rank, world, sharded)

    def save(self, name: str, replica: Any, wait: bool = True) -> Optional[Path]:
        """Every member writes its 1/W slice of the state; rank 0 commits once all W are on disk.

        ``replica`` is the worker's ``Replica`` (rank, world, generation, and whether the store still
        coordinates a save). ``wait=False`` (the interval saves) returns after an in-memory snapshot
        when ``checkpoint.async_save``; other saves (final, Ctrl-C, stop, agent lost) return once
        written, since the process may exit next. Returns the checkpoint's path on rank 0.
        """
        rank, world = replica.rank, replica.world
        arrays, progress = self.state_dict()  # views: the checkpointer copies only this rank's slice
        self.attempted_step = int(progress["step"])
        sharded = getattr(replica, "sharding", lambda: None)()  # trainer.shard: each rank holds (and writes) only its slice of the optimizer
        offline = world > 1 and not replica.coordinated()
        if offline and sharded is None:
            # No store, no coordinated save: the state is replicated, so one survivor writes all of it --
            # whichever claims it first. Not "rank 0": when the agent's host is lost, rank 0 is usually
            # lost with it, and the survivors on other hosts cannot agree on anything else.
            if not self._claim(name, replica.generation):
                return None
            rank, world, offline = 0, 1, False
        # Sharded, no worker holds all of the optimizer state: each writes its shard and its report beside it, and
        # the save is committed from those files later (finish.py), once all of them are there.
        info = {**progress, "epoch": progress["cursor"]["epoch"], "world_size": replica.world,
                "generation": replica.generation, "saved_at": time.time(), **self.recorded}
        return self.checkpointer.save(name, arrays, info, rank=rank, world=world, generation=replica.generation,
                                      wait=wait or offline, sharded=sharded, offline=offline,
                                      gone=_gone(replica) if world == replica.world else set)

    def _claim(self, name: str, generation: int) -> bool:
        """True for the one process that creates ``.<name>.solo-g<generation>`` in the job directory (an
        exclusive create, atomic on a local or NFS filesystem)."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.job_dir / f".{name}.solo-g{generation}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def load(self, path: Path) -> None:
        """Load checkpoint ``path`` into the training state: CheckpointMismatch if it is another model's,
        CorruptCheckpoint if it is damaged or does not fit this run (both found before anything is read or loaded)."""
        held = {n: (tuple(v.shape), v.dtype) for n, v in self.state_dict()[0].items()}
        try:
            arrays, meta = load_with_metadata(path, check=lambda meta: self._check(path, meta, held))
        except (TypeError, KeyError, IndexError, AttributeError, ValueError, OverflowError, RecursionError) as exc:
            # A field no check foresaw (the checks name the field; this names the error): still one line, and
            # resume=auto falls back past it rather than stop every worker with a traceback.
            raise CorruptCheckpoint(f"checkpoint '{path}' is corrupt: reading it failed ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})", HINT_FALLBACK) from None
        written, now = meta.get("model_file_sha256"), self.recorded["model_file_sha256"]
        if written and now and written != now:
            # A warning, not a refusal: an edit that keeps the tensors' names and shapes (a fix in forward(),
            # a new metric) is a resume users make on purpose; one that does not is refused above.
            log.warning("model file %s changed since checkpoint %s was written (sha256 %s then, %s now): "
                        "resuming from it; pass resume=none to start afresh", self.model_file,
                        path.name, written, now)
        # The checkpoint is by definition saved at its own step (older ones did not record it).
        try:
            self.load_state_dict(arrays, {**meta, "last_saved_step": int(meta["step"])})
        except (TypeError, ValueError, KeyError, OverflowError, AttributeError) as exc:
            # A progress record of the wrong type or range ("micro_step": "x", "skipped_steps": 1e999): corrupt,
            # so resume=auto falls back past it as past any other damage, instead of stopping the run.
            raise CorruptCheckpoint(f"checkpoint metadata '{path / METADATA}' holds progress this run cannot use "
                                    f"({type(exc).__name__}: {str(exc)[:200]})", HINT_FALLBACK) from None

    def _check(self, path: Path, meta: Dict[str, Any], held: Dict[str, Tuple[Tuple[int, ...], Any]]) -> None:
        """Refuse checkpoint ``path`` from its metadata (well formed: ``check_metadata``) before any of it is read:
        another model's (CheckpointMismatch), or one whose tensors or progress this run cannot hold (CorruptCheckpoint).
        ``held``: (shape, dtype) of each tensor of the run's state, by name."""
        # Optimizer slots and the outer optimizer's state (topology=diloco) may be absent or extra: a run starts
        # them afresh, or has none. Those it loads must fit (check_fit).
        expected = {n: shape for n, (shape, _) in held.items() if not n.startswith(EXTRA)}
        found = {n: tuple(t["shape"]) for n, t in meta["tensors"].items() if not n.startswith(EXTRA)}
        diffs = list(compare_names(expected, found))
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
            if set(expected) == set(found) and self._same_model(meta):
                # Every name, but shapes the model file and config that wrote it cannot make: damage, not a change
                # of model, so resume=auto falls back to the checkpoint before (a mismatch stops the run).
                raise CorruptCheckpoint(f"checkpoint metadata '{path / METADATA}' is corrupt: {shown}, though this "
                                        "model file and config wrote it", HINT_FALLBACK)
            raise CheckpointMismatch(f"checkpoint '{path}' does not match this model: {shown}",
                                     "resume with the model file that wrote it, or pass resume=none to start fresh")
        if meta.get("optimizer") != self.optimizer and any(n.startswith("optimizer/") for n in meta["tensors"]):
            raise CheckpointMismatch(f"checkpoint '{path}' holds {meta.get('optimizer')} state but this run uses "
                                     f"{self.optimizer}", "resume with the same optimizer, or pass resume=none")
        check_fit(path, meta, held)
        check_progress(path, meta, self.epoch_samples)

    def _same_model(self, meta: Dict[str, Any]) -> bool:
        """Whether checkpoint ``meta`` records this run's model file and config (as far as they shape it)."""
        now = self.recorded["model_file_sha256"]
        return now is not None and meta.get("model_file_sha256") == now and \
            meta.get("config_hash") == self.recorded["config_hash"]

    def resume(self) -> Optional[Path]:
        """Load what ``resume`` asks for; returns the checkpoint loaded (None: a fresh start).

        ``auto``: this job's newest complete checkpoint that loads (a corrupt one is skipped with a
        warning; one of another model stops the run, and so does a job none of whose checkpoints
        loads, rather than silently start fresh). ``none``: nothing. A path: that checkpoint, or the
        newest complete one of a job or checkpoint directory (an error if it does not load).
        """
        if self.resume_mode == "none":
            return None
        if self.resume_mode != "auto":
            path = resolve(Path(self.resume_mode).expanduser())
            self.load(path)
            return path
        try:  # the last save of an earlier run whose commit needed a store that could not be reached
            finish_pending(self.job_dir, self.checkpointer.token, self.checkpointer.timeout_s)
        except (ElasticFlowError, OSError) as exc:
            log.warning("a save of an earlier run left uncommitted was not finished: %s", getattr(exc, "message", exc))
        found = complete_checkpoints(self.job_dir)
        for i, path in enumerate(reversed(found)):
            try:
                self.load(path)
                return path
            except CheckpointMismatch:
                raise  # starting fresh would silently discard this job's training
            except ElasticFlowError as exc:
                if i == len(found) - 1:
                    raise ElasticFlowError(
                        f"none of the {len(found)} checkpoint(s) of job {self.job_dir} loads; the oldest, {path}: "
                        f"{exc.message}", "pass resume=none to start fresh, or resume=PATH to a checkpoint that "
                        "loads (elasticflow inspect PATH checks one)") from exc
                log.warning("skipping checkpoint %s: %s; falling back to the previous one", path, exc.message)
        return None

    def by_step(self) -> Dict[int, Path]:
        """This job's complete checkpoints by step, after waiting for a save in flight (it may be the
        newest); one whose metadata cannot be read is left out with a warning."""
        try:
            self.checkpointer.wait()
        except ElasticFlowError as exc:
            log.warning("the checkpoint in flight failed (%s)", exc.message)
        out: Dict[int, Path] = {}
        for path in complete_checkpoints(self.job_dir):
            try:
                out[int(read_metadata(path)["step"])] = path
            except (ElasticFlowError, KeyError, TypeError, ValueError) as exc:
                log.warning("skipping checkpoint %s: %s", path, getattr(exc, "message", exc))
        return out

    def protect(self, names: Any) -> None:
        """Keep the checkpoints ``names`` (the best-k: train/callbacks.py) beside the newest ``checkpoint.keep``."""
        self.checkpointer.protected = frozenset(names)

    def close(self) -> Optional[Path]:
        """Wait for a save in flight (a failed background write is raised here); its path on rank 0."""
        return self.checkpointer.close()

    def settle(self) -> None:
        """On an error exit: let a save in flight commit first (a worker leaves by ``os._exit``, which would stop
        its writer thread mid-file). Bounded by elastic.timeout_s; a failure of the save itself is
        logged, not raised over the error that ends the run."""
        try:
            self.checkpointer.wait(timeout_s=self.checkpointer.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("the checkpoint being written when the run failed did not commit: %s",
                        getattr(exc, "message", exc) or type(exc).__name__)

    def latest(self) -> Optional[Path]:
        return latest(self.job_dir)

    def require_final(self, final: Optional[Path], step: int, rank: int) -> None:
        """At the end of training, on rank 0 (which commits): if this run saved ``step`` (the final save, or an
        interval save of the last step), the newest committed checkpoint must hold it, else the run fails. (A run
        that saved nothing of it resumed at its last step: the state is on disk where it came from.)

        A final save that did not commit (a member killed while writing it, its report lost) used to end the
        run ``done`` with an older checkpoint, and the steps since it were lost without a word.
        """
        if rank != 0 or self.attempted_step != step:
            return
        newest = final or self.latest()
        try:
            saved = newest is not None and int(read_metadata(newest)["step"]) == step
        except (ElasticFlowError, OSError, ValueError, KeyError, TypeError):
            saved = False
        if not saved:
            lease = self.checkpointer.lease
            raise ElasticFlowError(
                f"the final checkpoint (step {step}) did not commit, so the trained state is not on disk "
                f"(the newest checkpoint is {newest.name if newest else 'none'}; see the warning above)",
                "run the same command again: it resumes from the newest checkpoint, or first commits this one if "
                f"every worker's shard of it is on disk (`elasticflow checkpoint commit "
                f"{lease.run_dir if lease else self.job_dir}` says which are missing)")

"""The global sample order, the data cursor, and one worker's slice of a global batch.

Global step k of an epoch consumes positions [k*B, (k+1)*B) of that epoch's seeded permutation,
whatever the number of workers, so every sample of every epoch is used exactly once.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import forms, samples
from .._util.context import _context
from ..errors import ElasticFlowError
from .forms import Columns, Mapped, NpyShards  # noqa: F401 - public: elasticflow.data.Mapped, ...


def _fields(raw: Any, what: str, collate: Any) -> Tuple[np.ndarray, ...]:
    """data()'s tuple of fields as arrays; a list of samples ([(x, y), ...]) is one line naming the fix.
    With a ``collate`` a field's rows may differ in length: they are kept one object per row."""
    if isinstance(raw, list) and raw and isinstance(raw[0], (tuple, dict)):
        raise ElasticFlowError(f"{what} returned a list of {len(raw)} samples; it returns the fields, each an array "
                               "with one row per sample (or a list of samples with collate(samples) in the model file)",
                               "stack them: return tuple(np.stack(field) for field in zip(*samples)), or define "
                               "collate(samples) to make each micro-batch from its samples")
    fields = []
    for i, a in enumerate(raw):
        try:
            fields.append(a if isinstance(a, np.ndarray) else np.asarray(a))
        except ValueError:  # numpy's "inhomogeneous shape": rows of unequal length in one field
            if collate is None:
                raise ElasticFlowError(f"{what} returned field #{i} with rows of different lengths (ragged)",
                                       samples.RAGGED_HINT) from None
            fields.append(_objects(a))
        if fields[-1].dtype == object and collate is None:
            raise ElasticFlowError(f"{what} returned field #{i} as Python objects (rows of different lengths?)",
                                   samples.RAGGED_HINT)
    return tuple(fields)


def _objects(rows: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.asarray(r) for r in rows]
    return out


class Dataset:
    """A checked view of what ``data(cfg)`` returned: ``arrays`` (a tuple of equal-length arrays held
    in memory) or a reader fetched batch by batch (see :mod:`elasticflow.data.forms` for every form)."""

    def __init__(self, raw: Any, what: str = "data()", collate: Optional[Callable[[List[Any]], Any]] = None,
                 names: Optional[Sequence[str]] = None):
        self.what, self.names = what, names  # names: forward()'s data parameters (a collate's dict goes by them)
        self.arrays: Tuple[np.ndarray, ...] | None = None
        self.reader: Any = None
        self._layout: Optional[List[Tuple[np.dtype, tuple]]] = None  # the first batch's dtypes and row shapes
        if isinstance(raw, np.ndarray):
            raw = (raw,)
        if isinstance(raw, dict):
            # A dict has __len__ and __getitem__, but its length counts keys, not samples.
            raise ElasticFlowError(f"{what} returned a dict (keys: {', '.join(map(str, raw))})",
                                   "return a tuple of arrays in forward()'s argument order, e.g. (x, y)")
        if isinstance(raw, list) and collate is not None and raw and isinstance(raw[0], (tuple, dict)):
            raw = forms.Mapped(raw, collate)  # a list of samples, made into micro-batches by the collate
        if isinstance(raw, (tuple, list)):
            arrays = _fields(raw, what, collate)
            if not arrays:
                raise ElasticFlowError(f"{what} returned an empty tuple", "return a tuple of arrays, e.g. (x, y)")
            lengths = [len(a) if a.ndim else -1 for a in arrays]
            if len(set(lengths)) != 1 or lengths[0] < 0:
                shown = ", ".join(f"#{i}: {n if n >= 0 else 'a scalar'}" for i, n in enumerate(lengths))
                raise ElasticFlowError(f"{what} returned arrays of unequal length ({shown} rows)",
                                       "every array must have one row per sample (same first dimension)")
            self.length = lengths[0]
            if collate is not None:  # per micro-batch: its samples' fields in, one batch out
                self.reader = forms.Samples(arrays, collate)
            elif any(isinstance(a, np.memmap) for a in arrays):  # on disk: read per batch, never all at once
                self.reader = forms.Mmapped(arrays)
            else:
                self.arrays = arrays
            return
        self.reader = forms.adapt(raw, what, collate)
        if self.reader is None and hasattr(raw, "__len__") and hasattr(raw, "__getitem__"):
            self.reader = forms.Indexed(raw)
        if self.reader is None:
            raise ElasticFlowError(f"{what} returned a {type(raw).__name__}",
                                   "return a tuple of equal-length numpy arrays, a map-style dataset (torch "
                                   "Dataset, Hugging Face datasets.Dataset), or an object with __len__ and "
                                   "__getitem__(indices) returning such a tuple")
        self.length = len(self.reader)

    def __len__(self) -> int:
        return self.length

    def fetch(self, indices: np.ndarray, epoch: Optional[int] = None) -> Tuple[np.ndarray, ...]:
        """The rows at ``indices`` as a tuple of numpy arrays (only for datasets read batch by batch).

        ``epoch`` is the epoch the rows are for: :func:`sample_rng` seeds augmentation with it.
        """
        _fetching.epoch = _context.epoch if epoch is None else epoch
        try:
            rows = self.reader.read(indices)
        except ElasticFlowError:
            raise
        except Exception as exc:
            raise self._read_error(indices, exc) from exc
        collate = getattr(self.reader, "collate_fn", None)
        try:
            rows = tuple(samples.as_array(r) for r in samples.fields_of(rows, self.names))
        except ValueError as exc:  # numpy's "inhomogeneous shape": a field of unpadded rows
            raise ElasticFlowError(f"{self._maker(collate)} returned a field numpy cannot make one array of, for "
                                   f"samples {_shown(indices)} ({exc})", samples.RAGGED_HINT) from None
        if any(r.ndim == 0 or len(r) != len(indices) for r in rows):
            raise ElasticFlowError(
                f"{self._maker(collate)} returned a batch whose arrays do not have len(indices)={len(indices)} "
                f"rows ({', '.join(str(r.shape) for r in rows)}) for samples {_shown(indices)}",
                "reading a batch must return one row per requested index in every array")
        if any(r.dtype == object for r in rows):
            field = next(i for i, r in enumerate(rows) if r.dtype == object)
            raise ElasticFlowError(f"{self._maker(collate)}'s batch of samples {_shown(indices)} has field #{field} "
                                   "as Python objects (rows of different lengths?)", samples.RAGGED_HINT)
        if collate is not None:
            return rows  # collated per micro-batch: shapes may differ from one micro-batch to the next
        layout = [(r.dtype, r.shape[1:]) for r in rows]
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise ElasticFlowError(
                f"{self.what}'s batch of samples {_shown(indices)} has fields {_describe(layout)}, but earlier "
                f"batches had {_describe(self._layout)}",
                samples.RAGGED_HINT if [d for d, _ in layout] == [d for d, _ in self._layout] else
                "every sample must have the same dtype and row shape in each field (pad or cast in data())")
        return rows

    def _maker(self, collate: Any) -> str:
        """Who made a bad batch, for its error: the collate (``pad()``), else the source (``data()``)."""
        return self.what if collate is None else f"{getattr(collate, '__name__', 'collate')}()"

    def _read_error(self, indices: np.ndarray, exc: Exception) -> ElasticFlowError:
        """The error naming the first sample whose read fails alone (found by reading one at a time)."""
        culprit = None
        for i in indices[:4096]:
            try:
                self.reader.read(np.asarray([i]))
            except Exception:
                culprit = int(i)
                break
        where = f"sample {culprit}" if culprit is not None else f"the batch of samples {_shown(indices)}"
        return ElasticFlowError(f"{self.what}: reading {where} raised {type(exc).__name__}: {exc}",
                                "fix the dataset's __getitem__ for that index (run with --debug for the traceback)")


_shown = samples.shown


def _describe(layout: List[Tuple[np.dtype, tuple]]) -> str:
    return ", ".join(f"#{i} {d} {s}" for i, (d, s) in enumerate(layout))


_fetching = threading.local()  # the epoch a fetch is for, per thread: prefetch threads read ahead of training


def sample_seed(index: int, epoch: Optional[int] = None) -> int:
    """A seed for sample ``index``'s randomness (augmentation): a function of the run's seed, the epoch
    and the sample index only, so an augmented sample is the same for any number of workers, with
    prefetch, and when a step is redone. Call it inside the dataset's ``__getitem__``.

    Example::

        def __getitem__(self, i):
            rng = np.random.default_rng(elasticflow.data.sample_seed(i))
            return random_crop(self.images[i], rng), self.labels[i]
    """
    context = _context
    if epoch is None:
        epoch = getattr(_fetching, "epoch", context.epoch)
    return micro_seed(context.seed, epoch, int(index), -1)


def sample_rng(index: int, epoch: Optional[int] = None) -> np.random.Generator:
    """A numpy generator seeded by :func:`sample_seed`."""
    return np.random.default_rng(sample_seed(index, epoch))


def permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's global sample order: the same on every worker for the same (seed, epoch); ``shuffle``
    False (``data.shuffle=false``): the samples in data()'s order, every epoch.

    >>> permutation(5, seed=0, epoch=0, shuffle=False)
    array([0, 1, 2, 3, 4])
    """
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def steps_per_epoch(num_samples: int, global_batch: int, drop_last: bool) -> int:
    full, rest = divmod(num_samples, global_batch)
    return full + (1 if rest and not drop_last else 0)


def split_evenly(total: int, parts: int) -> List[int]:
    """Sizes of ``parts`` contiguous shares of ``total``; the first ``total % parts`` get one more.

    >>> split_evenly(64, 3)
    [22, 21, 21]
    """
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def worker_share(batch_positions: Tuple[int, int], rank: int, world: int) -> Tuple[int, int]:
    """This rank's contiguous [start, end) within a global batch's positions [start, end)."""
    start, end = batch_positions
    sizes = split_evenly(end - start, world)
    lo = start + sum(sizes[:rank])
    return lo, lo + sizes[rank]


def micro_batches(start: int, end: int, micro_batch_size: int | None) -> List[Tuple[int, int]]:
    """Split [start, end) into pieces of at most ``micro_batch_size`` (None: one piece)."""
    if end <= start:
        return []
    size = micro_batch_size or (end - start)
    return [(lo, min(lo + size, end)) for lo in range(start, end, size)]


def split_by_cost(total: int, costs: Sequence[float]) -> List[int]:
    """Counts of ``total`` units for members whose unit takes ``costs[i]`` seconds, so that the slowest member's
    part (count x cost) is as short as it can be: each member one unit first (it keeps being measured), then
    each next unit to the member that would finish it soonest, ties to the lower rank. Equal costs give
    ``split_evenly``. A deterministic function of its arguments: every member computes the same counts.

    >>> split_by_cost(8, [1.0, 1.0, 4.0])
    [4, 3, 1]
    """
    return list(_split_by_cost(total, tuple(costs)))


@functools.lru_cache(maxsize=64)  # the costs change only when the shares do: one computation per batch size
def _split_by_cost(total: int, costs: Tuple[float, ...]) -> Tuple[int, ...]:
    world = len(costs)
    if total < world:
        return tuple(1 if i < total else 0 for i in range(world))
    # Most units in proportion to speed at once (each member's part no longer than the best finish), then the
    # rest (fewer than the members) one at a time, in O(world^2): a slowest part as short as dealing every unit
    # one at a time gives (checked against that on random costs)
    speed = [1.0 / max(c, 1e-12) for c in costs]
    counts = [max(1, int((total - world) * v / sum(speed))) for v in speed]
    if sum(counts) > total:
        counts = [1] * world
    for _ in range(total - sum(counts)):
        i = min(range(world), key=lambda r: ((counts[r] + 1) * costs[r], r))
        counts[i] += 1
    return tuple(counts)


@dataclass
class Share:
    """This worker's part of a global batch: micro-batches ``micro`` (position ranges), which are
    micro-batches ``first .. first + len(micro)`` of the ``total`` the global batch is cut into."""
    micro: List[Tuple[int, int]]
    first: int
    total: int


def deal(batch_positions: Tuple[int, int], rank: int, world: int, micro_batch_size: Optional[int],
         costs: Optional[Sequence[float]] = None) -> Share:
    """Cut a global batch into micro-batches and give this rank its contiguous run of them.

    With ``micro_batch_size`` the global batch is cut in global order into micro-batches of that size
    (the last may be smaller), and whole micro-batches are dealt out, balanced by count: each
    micro-batch, and whatever a model computes over one (BatchNorm's batch statistics, a dropout
    mask drawn for it), is the same for any number of workers. Without it each worker's share of the
    samples is one micro-batch, so such quantities depend on the number of workers.

    ``costs`` (seconds per micro-batch of each rank, train/balance.py) deals the micro-batches by speed instead
    (``split_by_cost``): the same micro-batches in the same order, only who computes which moves, so the step's
    sum is the same. Only with ``micro_batch_size``: a share of samples would change what a micro-batch is.

    >>> deal((0, 64), rank=1, world=3, micro_batch_size=10)
    Share(micro=[(30, 40), (40, 50)], first=3, total=7)
    >>> deal((0, 64), rank=0, world=3, micro_batch_size=10, costs=[1.0, 1.0, 4.0]).micro
    [(0, 10), (10, 20), (20, 30)]
    """
    start, end = batch_positions
    if not micro_batch_size:
        return Share(micro_batches(*worker_share(batch_positions, rank, world), None), rank, min(world, end - start))
    cut = micro_batches(start, end, micro_batch_size)
    counts = split_evenly(len(cut), world) if costs is None else split_by_cost(len(cut), costs)
    first = sum(counts[:rank])
    return Share(cut[first:first + counts[rank]], first, len(cut))


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def micro_seed(seed: int, epoch: int, batch_start: int, index: int) -> int:
    """The random seed of one micro-batch: a function of its place in the global order only (the run's
    seed, the epoch, the global batch's first position, the micro-batch's index in it), so a dropout
    mask is the same for any number of workers and when a step is redone. 63 bits (torch takes them).

    The global batch's position rather than the step number: a step skipped for a non-finite loss does
    not advance the step, and its successor must not draw the same masks.
    """
    # Distinct odd multipliers spread the four values over 64 bits; splitmix64 then mixes every bit
    # into every other (one round costs ~1 us in Python: this runs once per micro-batch).
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xC2B2AE3D27D4EB4F + batch_start * 0x165667B19E3779F9
         + index * 0xD6E8FEB86659FD93) & _MASK64
    return _splitmix64(_splitmix64(z)) >> 1


@dataclass
class Cursor:
    """Where training is in the data: replicated state, saved in every checkpoint."""
    epoch: int = 0
    samples_in_epoch: int = 0     # positions of this epoch's permutation already consumed
    samples_seen: int = 0         # all samples consumed since the start of training

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "samples_seen": self.samples_seen}


def check_size(num_samples: int, global_batch: int, what: str = "data()") -> None:
    if num_samples < global_batch:
        raise ElasticFlowError(
            f"{what} has {num_samples} samples, fewer than one global batch of {global_batch}",
            f"lower trainer.global_batch_size to at most {num_samples} or provide more data")




@dataclass
class GlobalBatch:
    """Positions [start, end) of one global batch in the epoch's permutation."""
    epoch: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


class Schedule:
    """Which global batches a run trains on: each epoch's permutation cut into global batches of the
    fixed size, until ``max_steps`` optimizer steps or ``epochs`` epochs, whichever comes first (both
    None: one epoch).

    It reads progress from a ``TrainState`` (``step`` and ``cursor``) and never changes it: the
    trainer moves the cursor once a step is committed, and a recovery may replace it.
    """

    def __init__(self, num_samples: int, global_batch: int, drop_last: bool, max_steps: Optional[int],
                 epochs: Optional[int]):
        self.global_batch, self.max_steps = global_batch, max_steps
        self.steps_per_epoch = steps_per_epoch(num_samples, global_batch, drop_last)
        self.max_epochs = epochs if epochs is not None else (None if max_steps else 1)
        horizon = [x for x in (max_steps, self.max_epochs and self.max_epochs * self.steps_per_epoch) if x]
        self.total_steps: Optional[int] = min(horizon) if horizon else None
        # drop_last: an epoch ends before its last, smaller global batch
        self.epoch_samples = (num_samples // global_batch) * global_batch if drop_last else num_samples

    def done(self, state: Any) -> bool:
        if self.max_steps is not None and state.step >= self.max_steps:
            return True
        return self.max_epochs is not None and state.cursor.epoch >= self.max_epochs

    def epochs(self, state: Any) -> Iterator[int]:
        """Epochs still to train, starting at the cursor's epoch."""
        epoch = state.cursor.epoch
        while not self.done(state) and (self.max_epochs is None or epoch < self.max_epochs):
            yield epoch
            epoch = state.cursor.epoch

    def batches(self, state: Any) -> Iterator[GlobalBatch]:
        """The cursor's epoch's remaining global batches; stops at the horizon."""
        epoch = state.cursor.epoch
        while not self.done(state):
            cursor = state.cursor  # read anew: a recovery may have adopted another member's
            if cursor.epoch != epoch or cursor.samples_in_epoch >= self.epoch_samples:
                return
            start = cursor.samples_in_epoch
            yield GlobalBatch(epoch, start, min(start + self.global_batch, self.epoch_samples))

    def ahead(self, batch: GlobalBatch, share: Share, depth: int, step: int, rank: int, world: int,
              micro_batch_size: Optional[int], costs: Optional[Sequence[float]] = None) -> List[Tuple[int, int, int]]:
        """The prefetcher's keys (epoch, start, end): this worker's micro-batches of ``batch`` (``share``),
        then of the global batches after it until ``depth`` more are named; empty for ``depth`` 0 (arrays
        held in memory). ``step``: the optimizer steps done before ``batch``; ``costs``: ``deal``'s, as they stand.

        Note: with one micro-batch per step, naming only the next global batch (as this once did) kept
        one batch read ahead whatever ``data.prefetch`` said, and with two loaders one idled while the
        step computed. Nothing is named past the run's last step: a batch read there is never trained.
        """
        if not depth:
            return []
        keys = [(batch.epoch, a, b) for a, b in share.micro]
        epoch, start = batch.epoch, batch.end
        # At most `depth` global batches: a share may be empty (more workers than samples in a batch).
        later = depth if self.total_steps is None else min(depth, self.total_steps - step - 1)
        for _ in range(later):
            if len(keys) >= len(share.micro) + depth:
                break
            if start >= self.epoch_samples:  # the next global batch opens the next epoch
                epoch, start = epoch + 1, 0
            stop = min(start + self.global_batch, self.epoch_samples)
            keys += [(epoch, a, b) for a, b in deal((start, stop), rank, world, micro_batch_size, costs).micro]
            start = stop
        return keys


ON_DEVICE_MAX_BYTES = 2 << 30  # trainer.data_on_device=null: array datasets up to 2 GiB live on the GPU


class Source:
    """A dataset as the backend's tensors: positions in, a batch (tuple of tensors) out.

    An array dataset is converted once (resident) and batches are gathered from it by index; an
    indexable one is fetched and converted batch by batch. ``backend`` is the backend module.
    """

    def __init__(self, dataset: Dataset, backend: Any, placement: Any = None, on_device: Optional[bool] = None):
        self.dataset, self.backend = dataset, backend
        gpu = placement if placement is not None and placement.kind != "cpu" else None
        arrays = dataset.arrays
        if on_device is None:  # null: on the GPU when the arrays are small next to any GPU's memory
            on_device = arrays is not None and sum(np.asarray(a).nbytes for a in arrays) <= ON_DEVICE_MAX_BYTES
        self.resident = None if arrays is None else backend.resident(arrays, gpu if on_device else None)
        # Where batches are made on the host, they travel to the GPU one at a time (pinned, non-blocking).
        self.move_to = gpu if gpu is not None and (arrays is None or not on_device) else None

    def __len__(self) -> int:
        return len(self.dataset)

    def order(self, seed: int, epoch: int, shuffle: bool) -> Any:
        """The epoch's sample order: ``permutation``, or the reader's own (``Shards``: shuffled within windows of
        shards, computed a window at a time); either is sliced ``order[a:b]``."""
        own = getattr(self.dataset.reader, "order", None)
        return own(seed, epoch, shuffle) if own is not None else permutation(len(self), seed, epoch, shuffle)

    def rows(self, positions: np.ndarray, epoch: Optional[int] = None):
        if self.resident is not None:
            batch = self.backend.gather(self.resident, self.backend.index(positions))
            return batch if self.move_to is None else self.backend.to_device(batch, self.move_to)
        return self.convert(self.dataset.fetch(positions, epoch))

    def convert(self, rows: Tuple[np.ndarray, ...]):
        """Host rows as the backend's tensors, on the training device."""
        batch = tuple(self.backend.to_tensor(x) for x in rows)
        return batch if self.move_to is None else self.backend.to_device(batch, self.move_to)

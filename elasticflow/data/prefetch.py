"""This worker's next micro-batches, read and converted to tensors in the background.

A batch is named by its place in the global order, ``(epoch, start, end)`` positions of that epoch's
permutation, never by a step or a rank. So exactly-once does not depend on prefetch: when the
membership changes, the shares change, the plan names other batches, and what was read for the old
share is dropped unread; a redone step asks for its batches again and reads them again.

``data.workers`` threads read (and convert) ahead; with ``data.worker_type=process`` the reading
(the user's ``__getitem__``, decoding) runs in as many forked processes, out of the GIL's way, and
only the conversion to tensors stays in this process. A loader has ``ELASTICFLOW_DATA_LOADER=1`` in
its environment.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._util import affinity
from . import order as data
from ..errors import ElasticFlowError

Key = Tuple[int, int, int]  # (epoch, start, end): positions [start, end) of the epoch's permutation


class Prefetcher:
    """Batches by :data:`Key`: ``take(key, ahead)`` returns ``key``'s batch and starts reading the
    first ``depth`` keys of ``ahead``.

    Args:
        source: the training ``data.Source``.
        seed: the run's seed (the epochs' permutations).
        depth: micro-batches read ahead of the one being trained (0: read on demand, in this thread).
        workers: threads (or processes) reading at once.
        worker_type: ``thread`` or ``process``.
        shuffle: each epoch a permutation (``data.permutation``); False: data()'s order.
    """

    def __init__(self, source: data.Source, seed: int, depth: int, workers: int, worker_type: str = "thread",
                 shuffle: bool = True):
        self.source, self.seed, self.shuffle = source, seed, shuffle
        # Arrays held in memory are gathered in microseconds: reading ahead would only add a thread hop.
        self.depth = depth if source.resident is None else 0
        self.workers, self.worker_type = max(1, workers), worker_type
        self.pending: "OrderedDict[Key, Future]" = OrderedDict()
        self._orders: Dict[int, np.ndarray] = {}
        self._orders_lock = threading.Lock()  # reader threads ask for the next epoch's order
        self._threads: Optional[ThreadPoolExecutor] = None
        self._processes: Any = None

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's order (``Source.order``; two kept: the current epoch and the next, read ahead into)."""
        with self._orders_lock:
            if epoch not in self._orders:
                if len(self._orders) >= 2:
                    self._orders.pop(min(self._orders))
                self._orders[epoch] = self.source.order(self.seed, epoch, self.shuffle)
            return self._orders[epoch]

    def take(self, key: Key, ahead: List[Key] = ()):
        """``key``'s batch as tensors; the first ``depth`` keys of ``ahead`` start reading."""
        if self.depth == 0:
            return self._ready(key, self._start(key)) if self.worker_type == "process" else self._load(key)
        wanted = [k for k in ahead[:self.depth] if k != key]
        for k in list(self.pending):  # no longer this worker's (the shares changed), or already passed
            if k != key and k not in wanted:
                self.pending.pop(k).cancel()
        for k in wanted:
            if k not in self.pending:
                self.pending[k] = self._start(k)
        future = self.pending.pop(key, None) or self._start(key)
        return self._ready(key, future)

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None
        if self._processes is not None:
            self._processes.shutdown(wait=False, cancel_futures=True)
            self._processes = None

    def _start(self, key: Key) -> Future:
        """Start reading ``key``: in a thread (read and convert), or in a loader process (read only:
        its task queue stays full, so a loader never idles while this process converts)."""
        if self.worker_type != "process":
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.workers, thread_name_prefix="elasticflow-data",
                                                   initializer=affinity.release)
            return self._threads.submit(self._load, key)
        epoch, start, end = key
        try:
            return self._process_pool().submit(_read_in_loader, self.order(epoch)[start:end], epoch)
        except BrokenProcessPool as exc:  # a loader died while an earlier read was in flight
            raise self._loader_died(key) from exc

    def _ready(self, key: Key, future: Future):
        """The batch of a started read, as tensors (a loader's rows are converted here: from_numpy, no copy)."""
        if self.worker_type != "process":
            return future.result()
        try:
            return self.source.convert(_as_numpy(future.result()))
        except BrokenProcessPool as exc:
            raise self._loader_died(key) from exc

    def _loader_died(self, key: Key) -> ElasticFlowError:
        self._processes = None
        epoch, start, end = key
        return ElasticFlowError(
            f"a data loader process died while reading samples of epoch {epoch} (positions {start}..{end})",
            "a process killed for memory or crashed inside the dataset's __getitem__; lower data.workers, "
            "or use data.worker_type=thread to see the error in this process")

    def _load(self, key: Key):
        epoch, start, end = key
        return self.source.rows(self.order(epoch)[start:end], epoch)

    def _process_pool(self):
        if self._processes is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # fork: the loaders inherit the dataset object (a model file's class need not be importable
            # by name, so spawn could not unpickle it). torch.utils.data.DataLoader forks too.
            self._processes = ProcessPoolExecutor(self.workers, multiprocessing.get_context("fork"),
                                                  initializer=_loader_init, initargs=(self.source.dataset,))
            self._processes.submit(int).result()  # fork now, from this (the main) thread: PR_SET_PDEATHSIG's parent
        return self._processes


_loader_dataset: Any = None


def _loader_init(dataset: data.Dataset) -> None:
    global _loader_dataset
    _loader_dataset = dataset
    affinity.release()  # forked from the pinned training thread: a loader decodes on any core
    if sys.platform.startswith("linux"):  # die with the worker: a SIGKILLed worker leaves no loaders behind
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if "torch" in sys.modules:  # one thread per loader, as DataLoader's workers: the cores are the trainer's
        sys.modules["torch"].set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    os.environ["ELASTICFLOW_DATA_LOADER"] = "1"


def _read_in_loader(positions: np.ndarray, epoch: int) -> Tuple[Any, ...]:
    rows = _loader_dataset.fetch(positions, epoch)
    torch = sys.modules.get("torch")
    if torch is None:
        return rows
    # As torch tensors, the rows travel as shared memory (torch's reducers for multiprocessing move the
    # storage there and pass its file descriptor), as DataLoader's do, rather than being pickled through
    # the result pipe: one copy instead of three, and no 64 KiB pipe round trips for a large batch.
    out = []
    for r in rows:
        try:
            out.append(torch.from_numpy(r if r.flags.writeable else r.copy()))  # from_numpy warns on read-only
        except TypeError:  # a dtype torch has no tensor for: pickled as it is
            out.append(r)
    return tuple(out)


def _as_numpy(rows: Tuple[Any, ...]) -> Tuple[np.ndarray, ...]:
    return tuple(r if isinstance(r, np.ndarray) else r.numpy() for r in rows)  # a view of the shared memory

"""Data: the global sample order and each worker's share of a batch (``order``), the forms ``data()`` may
return (``forms``), and the next micro-batches read ahead (``prefetch``).

Public (``elasticflow.data``): the dataset forms ``Mapped``, ``Columns``, ``NpyShards`` and ``Shards`` (a corpus
of shard files: ``shards``, ``shard_formats``), the per-sample randomness ``sample_seed`` and ``sample_rng``, and
the epoch order ``permutation``.
"""
from .forms import Columns, Mapped, NpyShards
from .order import Dataset, permutation, sample_rng, sample_seed
from .shards import Shards

__all__ = ["Columns", "Mapped", "NpyShards", "Shards", "Dataset", "permutation", "sample_rng", "sample_seed"]

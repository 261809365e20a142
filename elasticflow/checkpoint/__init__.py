"""Checkpoints: ``load(path) -> {name: numpy array}``, ``latest(dir)``, and the sharded writer the trainer uses.

Layout: ``checkpoint.dir/<job>_<timestamp>/step_<N>/`` with one safetensors shard per writing
rank, metadata.json and COMMIT (see ``format``). A checkpoint written by N ranks loads with any M.
"""
from .coordinator import Coordinator, LocalCoordinator, StoreCoordinator, store_alive
from .format import (METADATA, complete_checkpoints, config_hash, is_complete, job_dirs, latest, read_metadata, resolve,
                     shard_name)
from .load import compare_names, load, load_with_metadata
from .save import Checkpointer, save

__all__ = ["load", "latest", "save", "read_metadata", "is_complete", "complete_checkpoints", "job_dirs", "resolve",
           "load_with_metadata", "compare_names", "shard_name", "Checkpointer", "Coordinator", "LocalCoordinator",
           "StoreCoordinator", "METADATA", "store_alive", "config_hash"]

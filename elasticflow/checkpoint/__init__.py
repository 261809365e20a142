"""Checkpoints: ``load(path) -> {name: numpy array}``, ``latest(dir)``, the sharded writer, and the
trainer-facing ``CheckpointManager`` (when to save, what a save records, resume).

Layout: ``checkpoint.dir/<job>_<timestamp>/step_<N>/`` with one safetensors shard per writing
rank, metadata.json and COMMIT (see ``format``). A checkpoint written by N ranks loads with any M.
"""
from .coordinator import Coordinator, LocalCoordinator, StoreCoordinator, store_alive
from .format import (METADATA, CorruptCheckpoint, complete_checkpoints, config_hash, is_complete, job_dirs, latest,
                     read_metadata, resolve, shard_name)
from .load import compare_names, load, load_with_metadata
from .save import Checkpointer, save
from .manager import CheckpointInterval, CheckpointManager

__all__ = ["load", "latest", "save", "read_metadata", "is_complete", "complete_checkpoints", "job_dirs", "resolve",
           "load_with_metadata", "compare_names", "shard_name", "Checkpointer", "Coordinator", "LocalCoordinator",
           "StoreCoordinator", "METADATA", "CorruptCheckpoint", "store_alive", "config_hash", "CheckpointInterval",
           "CheckpointManager"]

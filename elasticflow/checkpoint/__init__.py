"""Checkpoints: ``load(path) -> {name: numpy array}``, ``latest(dir)``, and the writer the trainer uses."""
from .format import complete_checkpoints, is_complete, latest, read_metadata
from .load import compare_names, load, load_with_metadata
from .save import save

__all__ = ["load", "latest", "save", "read_metadata", "is_complete", "complete_checkpoints",
           "load_with_metadata", "compare_names"]

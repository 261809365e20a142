"""A Hugging Face streaming dataset (``load_dataset(..., data_files=..., streaming=True)``) read at any position:
the ``Shards`` of its files, with its one-example-in, one-example-out transforms replayed on each sample as it is
read (``Replayed``).

``datasets`` keeps a stream's transforms as a chain of "examples iterables" (``stream._ex_iterable``: each node
wraps the one below it, the files' reader at the bottom) and a cast as the stream's ``features``. A transform that
turns each example into one example (``map`` without ``batched``, ``select_columns``, ``rename_column(s)``,
``remove_columns``, ``cast``/``cast_column``, ``with_format``; a batched ``map`` that returns one row per row) is a
function of the example and its position, so the sample at position i is the same wherever, whenever and however
often it is read: exactly-once holds as it does for the files. Each node is replayed as ``datasets`` applies it
(``MappedExamplesIterable._iter``'s argument and column rules), one example at a time, so a batched map's result does
not depend on how many workers share a batch. Transforms that change the number of samples (``filter``,
``shuffle(buffer_size)``, ``take``/``skip``, ``split_dataset_by_node``, a batched map that returns another number of
rows) cannot be read at a position: refused in one line, saying what to do instead.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..errors import ElasticFlowError
from .shards import Shards

Step = Callable[[Dict[str, Any], int], Dict[str, Any]]  # (example, its position in the stream) -> example

REPLAYED = ("map (per example, or batched with one row out per row in), select_columns, rename_column(s), "
            "remove_columns, cast, cast_column, with_format")

# Nodes that change the number of samples or their order, by class name: what the user did, what to do instead.
_REFUSED = {
    "FilteredExamplesIterable": (".filter(), which changes the number of samples",
                                 "filter the files once and stream the kept ones (e.g. load_dataset without "
                                 "streaming=True, .filter(f), .to_json('kept.jsonl')), or return that "
                                 "datasets.Dataset itself"),
    "BufferShuffledExamplesIterable": (".shuffle(buffer_size=...), which reorders samples as they stream",
                                       "drop .shuffle(): ElasticFlow shuffles every epoch itself (data.shuffle, "
                                       "by windows of shards)"),
    "InterleavedShardsExamplesIterable": (".shuffle(), which reorders the files as they stream",
                                          "drop .shuffle(): ElasticFlow shuffles every epoch itself (data.shuffle)"),
    "TakeExamplesIterable": (".take(n), which changes the number of samples",
                             "list only the files to train on in data_files=, or stop early with trainer.max_steps"),
    "SkipExamplesIterable": (".skip(n), which changes the number of samples",
                             "list only the files to train on in data_files=, or resume from a checkpoint"),
    "RepeatExamplesIterable": (".repeat(n), which changes the number of samples", "set trainer.epochs instead"),
    "StepExamplesIterable": ("split_dataset_by_node() or .shard(), which keeps some samples only",
                             "return the whole stream: ElasticFlow deals the samples to the workers itself"),
}
_MULTI = ("concatenate_datasets() or interleave_datasets(), whose samples come from several streams",
          "pass every file to one load_dataset(..., data_files=[...], streaming=True)")


class Replayed(Shards):
    """The ``Shards`` of a stream's files whose samples pass through ``steps`` (its transforms, lowest first) as
    they are read. ``first``: each shard's first sample's position in the stream's own order (``datasets`` reads
    ``data_files`` in the order given; ``Shards`` sorts them): a step is given its sample's position there (what a
    map ``with_indices=True`` receives)."""

    def __init__(self, files: Sequence[str], steps: List[Step]):
        super().__init__(list(files))
        self.steps = steps
        counts = {s.path: len(s) for s in self.shards}
        first, at = {}, 0
        for path in map(os.path.abspath, files):  # the stream's order
            if path not in first:
                first[path] = at
                at += counts.get(path, 0)
        self.first = np.asarray([first[s.path] for s in self.shards], dtype=np.int64)

    def samples(self, indices: np.ndarray) -> List[Any]:
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        positions = (self.first[which] + indices - self.offsets[which]).tolist()
        out = []
        for example, position in zip(super().samples(indices), positions):
            for step in self.steps:
                example = step(example, position)
            out.append(example)
        return out


def from_hugging_face(stream: Any, what: str) -> Shards:
    """A Hugging Face ``IterableDataset`` over data files as the ``Shards`` of those files, its transforms replayed
    per sample (``Replayed``); one whose transforms change the number of samples is refused."""
    nodes: List[Any] = []  # top first
    node = getattr(stream, "_ex_iterable", None)
    while node is not None and type(node).__name__ not in ("ArrowExamplesIterable", "ExamplesIterable"):
        _refuse_node(node, what)
        nodes.append(node)
        node = getattr(node, "ex_iterable", None)
    files = getattr(node, "kwargs", {}).get("original_files") if node is not None else None
    if not files:
        raise ElasticFlowError(f"{what} returned a Hugging Face IterableDataset that is not read from data files "
                               f"({type(node or stream).__name__}), which can only be read in order",
                               "load it with load_dataset(FORMAT, data_files=..., streaming=True), or return a "
                               "datasets.Dataset (without streaming=True)")
    if getattr(stream, "_distributed", None) is not None:
        raise ElasticFlowError(f"{what} returned a Hugging Face IterableDataset split with "
                               f"{_REFUSED['StepExamplesIterable'][0]}", _REFUSED["StepExamplesIterable"][1])
    # What the loader read the files as: a cast is a stream whose features differ from these.
    reader = getattr(node, "generate_tables_fn", None) or getattr(node, "generate_examples_fn", None)
    loaded = getattr(getattr(getattr(reader, "__self__", None), "info", None), "features", None)
    steps = _steps(list(reversed(nodes)), stream, loaded, what)
    try:
        shards = Replayed(list(files), steps) if steps else Shards(list(files))
    except ElasticFlowError as exc:
        raise ElasticFlowError(f"{what} returned a Hugging Face IterableDataset over files ElasticFlow cannot "
                               f"index: {exc.message}", exc.hint) from None
    if steps:
        shards.samples(np.zeros(1, dtype=np.int64))  # the transforms fail on the first sample now, not at step 1
    return shards


def _refuse_node(node: Any, what: str) -> None:
    name = type(node).__name__
    done = _REFUSED.get(name) or (_MULTI if "MultiSources" in name else None)
    if done is None and name not in ("MappedExamplesIterable", "SelectColumnsIterable", "FormattedExamplesIterable",
                                     "RebatchedArrowExamplesIterable"):
        done = (f"a transform ElasticFlow cannot replay at a position ({name})", f"use only {REPLAYED}")
    if done is None and name == "MappedExamplesIterable" and node.batched and node.drop_last_batch:
        done = (".map(batched=True, drop_last_batch=True), which drops samples", "drop drop_last_batch=True")
    if done is None and name in ("MappedExamplesIterable", "FormattedExamplesIterable") and _table(node.formatting):
        done = (f"with_format({node.formatting.format_type!r}) before a transform",
                "use with_format('numpy'), 'torch' or none: a sample must be one example, not a table")
    if done is not None:
        raise ElasticFlowError(f"{what} returned a Hugging Face IterableDataset with {done[0]}; exactly-once "
                               "training reads each sample at its position in the files", done[1])


def _table(formatting: Any) -> bool:
    return formatting is not None and formatting.is_table


def _steps(nodes: List[Any], stream: Any, loaded: Any, what: str) -> List[Step]:
    """The per-example steps of ``nodes`` (lowest first), then the stream's own cast and format (as
    ``IterableDataset._prepare_ex_iterable_for_iteration`` adds them)."""
    steps: List[Step] = []
    changed = False  # a node below changed the columns: a node's features no longer equal the loaded ones
    for node in nodes:
        name = type(node).__name__
        if name == "MappedExamplesIterable":
            steps.append(_mapped(node))
            changed = True
        elif name == "SelectColumnsIterable":
            steps.append(_selected(list(node.column_names)))
            changed = True
        elif name == "FormattedExamplesIterable":
            # The files' own features (what the loader inferred) change nothing: skipped, for speed.
            features = node.features if (changed or node.features != loaded) else None
            step = _formatted(features, node.formatting, node.token_per_repo_id)
            if step is not None:
                steps.append(step)
    top = nodes[-1].features if nodes else loaded
    features = stream.features if stream.features and stream.features != top else None
    if _table(stream._formatting):
        raise ElasticFlowError(f"{what} returned a Hugging Face IterableDataset with_format("
                               f"{stream._formatting.format_type!r}), whose samples are tables",
                               "use with_format('numpy'), 'torch' or none: a sample must be one example")
    step = _formatted(features, stream._formatting, stream._token_per_repo_id)
    return steps + ([step] if step is not None else [])


def _selected(columns: List[str]) -> Step:
    return lambda example, position: {c: example[c] for c in columns}


def _formatted(features: Any, formatting: Any, token_per_repo_id: Any) -> Optional[Step]:
    """A cast to ``features`` (encoded then decoded: a ``ClassLabel``'s name becomes its id, an ``Image`` path its
    image) and a tensor format (``with_format("torch")``), as ``FormattedExamplesIterable`` applies them."""
    tensorize = _tensorize(formatting)
    if features is None and tensorize is None:
        return None
    from datasets.iterable_dataset import _apply_feature_types_on_example

    def step(example: Dict[str, Any], position: int) -> Dict[str, Any]:
        if features is not None:
            example = _apply_feature_types_on_example(example, features, token_per_repo_id=token_per_repo_id)
        return tensorize(example) if tensorize is not None else example
    return step


def _tensorize(formatting: Any) -> Optional[Callable[[Dict[str, Any]], Dict[str, Any]]]:
    if formatting is None or formatting.format_type is None:
        return None
    from datasets.formatting import get_formatter
    from datasets.formatting.formatting import TensorFormatter

    formatter = get_formatter(formatting.format_type)
    return formatter.recursive_tensorize if isinstance(formatter, TensorFormatter) else None


def _mapped(node: Any) -> Step:
    """``datasets``' ``map`` on one example: the function's arguments (the example, or its ``input_columns``; the
    position ``with_indices``; ``fn_kwargs``), its result merged over the example less ``remove_columns``. Batched:
    called on a batch of this one example, and it must return one row."""
    fn, batched, columns = node.function, node.batched, node.input_columns
    with_indices, remove, kwargs = node.with_indices, list(node.remove_columns or ()), dict(node.fn_kwargs or {})
    tensorize = _tensorize(node.formatting) if batched else None  # per example, the node below formatted it
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "function")

    def step(example: Dict[str, Any], position: int) -> Dict[str, Any]:
        example = {k: [v] for k, v in example.items()} if batched else dict(example)
        if tensorize is not None:
            example = tensorize(example)
        inputs = dict(example)
        args = [example] if columns is None else [example[c] for c in columns]
        if with_indices:
            args.append([position] if batched else position)
        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                import asyncio

                out = asyncio.run(out)
        except ElasticFlowError:
            raise
        except Exception as exc:
            raise ElasticFlowError(f"the .map() function {name} raised {type(exc).__name__}: {exc} (on the "
                                   f"stream's sample {position})",
                                   f"fix {name} (run with --debug for the traceback)") from exc
        out = {} if out is None else out
        for c in remove:
            inputs.pop(c, None)
            if out is example:
                out.pop(c, None)
        merged = {**inputs, **out}
        if not batched:
            return merged
        rows = {len(v) if hasattr(v, "__len__") else "no list of" for v in merged.values()}
        if rows and rows != {1}:
            counts = " and ".join(sorted(map(str, rows)))
            raise ElasticFlowError(f"the batched .map() function {name} returned {counts} rows for 1 (the "
                                   f"stream's sample {position}); a sample is read at its position, so a map must "
                                   "return one row per row",
                                   "pack or split samples when writing the files, or in collate(samples); a batched "
                                   "map that returns fewer or more rows cannot be replayed")
        return {k: v[0] for k, v in merged.items()} if rows else merged
    return step

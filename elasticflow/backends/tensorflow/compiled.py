"""The TensorFlow Engine's compiled steps: a ``tf.function``, called through its flat entry point.

Calling a ``tf.function`` costs about 150 us here in Python before any kernel runs: binding the
arguments to its FunctionType, matching them to a concrete function, checking for gradient tapes.
On a small model that is 40% of a training step, and a hand-written loop pays it too. The Engine
calls each step with one argument of a fixed structure (row indices, or a tuple of tensors) and
never under a GradientTape, so ``Compiled`` asks ``tf.function`` for the concrete function once per
input signature (shapes and dtypes) and then calls its flat form: the same graph, the same kernels,
the same results (the digits MLP step, called warm: 370 us through tf.function, 220 us flat).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, List, Tuple

import tensorflow as tf

_log = logging.getLogger("elasticflow")
EXACT_SHAPES = 8  # input signatures of one structure traced exactly, before varying dimensions become None


def _flat(inputs: Any) -> Tuple[Any, ...]:
    """The tensors a call passes, in the concrete function's order (a tuple's own order)."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


class Compiled:
    """``fn(inputs)`` compiled with ``tf.function``; calling it returns what ``fn`` returns.

    Args:
        fn: a step taking one argument: a tensor, or a tuple of tensors.

    Exact shapes (no input signature): a model file may read ``x.shape[0]``; the cost is one trace
    per distinct input signature (typically two: the full micro-batch and the epoch's last). Where a
    collate pads each micro-batch to its own length, shapes keep changing: after ``EXACT_SHAPES``
    signatures of one structure, the dimensions that varied are traced as unknown (``None``), as
    ``tf.function(reduce_retracing=True)`` and Keras's ``fit`` do, so a run traces at most a few more
    times whatever its lengths (a model that needs such a dimension reads ``tf.shape(x)``).
    Autograph is off: forward() keeps plain Python semantics and errors keep their type.

    Note: the flat entry point, ``AtomicFunction.call_flat``, is TensorFlow's private API (present
    from 2.14 through 2.21, the version setup.sh installs). Where it is missing, or a function
    captures something that is re-read on each call, the public call is used: slower, same result.
    """

    def __init__(self, fn: Callable[[Any], Any]):
        # A partial has no __code__, so TF's "excessive retracing" detector counts this step's own
        # traces, not those of every Engine that compiled the same code (a sweep's jobs in one process).
        self.function = tf.function(functools.partial(fn), autograph=False)
        self._calls: Dict[tuple, Callable[[Tuple[Any, ...]], Any]] = {}
        self._traced: Dict[tuple, List[tuple]] = {}  # per structure (ranks, dtypes): the signatures traced exactly

    def __call__(self, inputs: Any) -> Any:
        flat = _flat(inputs)
        # shape and dtype are cached on an eager tensor: the key costs about 0.2 us a tensor
        signature = (flat is inputs,) + tuple((t.shape, t.dtype) for t in flat)
        call = self._calls.get(signature)
        if call is None:
            call = self._calls[signature] = self._entry(self._relaxed(inputs, flat, signature))
        return call(flat)

    def _relaxed(self, inputs: Any, flat: Tuple[Any, ...], signature: tuple) -> Any:
        """``inputs`` to trace exactly, or, past ``EXACT_SHAPES`` signatures of their structure, ``TensorSpec``s
        with every dimension that has varied as ``None`` (the same spec again reuses its trace)."""
        if not all(isinstance(t, tf.Tensor) for t in flat):
            return inputs
        structure = (signature[0],) + tuple((len(shape), dtype) for shape, dtype in signature[1:])
        traced = self._traced.setdefault(structure, [])
        if len(traced) < EXACT_SHAPES:
            traced.append(signature)
            return inputs
        specs = []
        for i, t in enumerate(flat):
            seen = [sig[i + 1][0] for sig in traced] + [t.shape]
            dims = [d[0] if len(set(d)) == 1 else None for d in zip(*seen)]
            specs.append(tf.TensorSpec(dims, t.dtype))
        return tuple(specs) if signature[0] else specs[0]

    def _entry(self, inputs: Any) -> Callable[[Tuple[Any, ...]], Any]:
        """How to call with ``inputs``' signature: ``entry(flat tensors) -> fn's output``."""
        concrete = self.function.get_concrete_function(inputs)  # traces, if the signature is new
        try:
            atomic = concrete._inference_function
            pack, call_flat = atomic.function_type.pack_output, atomic.call_flat
            fixed = not any(callable(c) for c in concrete._captured_inputs)  # a callable is re-read per call
        except AttributeError:
            fixed = False
        if not fixed:
            _log.debug("tensorflow %s: a compiled step takes the public (slower) call", tf.__version__)
            as_tuple = isinstance(inputs, tuple)
            return lambda flat: self.function(flat if as_tuple else flat[0])
        captures = tuple(concrete.captured_inputs)  # the variables and resident tensors the graph reads
        return lambda flat: pack(call_flat(*flat, *captures))

    def experimental_get_tracing_count(self) -> int:
        return self.function.experimental_get_tracing_count()

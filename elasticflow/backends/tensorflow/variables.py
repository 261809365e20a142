"""A model's variables as the TensorFlow ``Engine`` holds them: built in the flat order, read and written by name.

torch's ``variables.py`` makes its parameters views of one flat tensor; a TF variable cannot
be a view of another, so a dict model's float arrays live in ONE flat variable and a native model keeps its
own variables; either way the flat order, the by-name views (checkpoints) and the torch copy for a sharded
update (``flat_params``) are computed here, once, for the Engine, its optimizer and its steps.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from ...errors import ElasticFlowError
from ...config.optim import OptimizerSpec
from ..buffers import Rule
from ..common import flatten, rebuild
from . import optim as tf_optim
from .data import _view, np_dtype, to_numpy
from .native import buffer_rules, is_native, native_variables, owners


class Variables:
    """The variables of one model in the flat order: the trained ones (``targets``), its buffers and frozen weights.

    Args:
        model: what ``model(cfg)`` returned, without the "optimizer" key (a dict of arrays or a native model).
        spec: the optimizer spec; its groups (``optimizer.groups``/``no_decay``) set the flat order.

    ``names``, ``shapes``, ``sizes``: per parameter, in the flat order (each group contiguous). ``targets``:
    the variables the optimizer updates, a native model's own one per parameter, or a dict model's one
    flat variable; ``target_shapes``/``target_sizes`` are theirs.

    One flat variable for a dict model: its update is then a handful of ops on three flat vectors whatever
    the number of parameters (per variable, an Adam update of a 20-tensor model is 400 graph ops, each with
    its own dispatch cost). Its integer arrays are buffers, kept as they are.
    """

    def __init__(self, model: Any, spec: OptimizerSpec):
        self.native = model if is_native(model) else None
        self.buffers: Dict[str, Any] = {}
        self.frozen: Dict[str, Any] = {}  # keras weights with trainable=False: state that nothing changes
        named: Dict[str, Any] = {}  # the parameters: a native model's variables, or a dict model's arrays
        if self.native is not None:
            named, self.buffers, self.frozen = native_variables(model)
        else:
            self._tree = model
            for name, value in flatten(model):
                array = to_numpy(value)
                if np.issubdtype(array.dtype, np.floating):
                    named[name] = array.astype(np.float32)
                else:
                    self.buffers[name] = tf.Variable(array, trainable=False)
        if not named:
            hint = ("build the keras model before returning it (start it with keras.Input(shape) or call "
                    "model.build(shape))" if self.native is not None
                    else "return a dict of float arrays, e.g. {'W': np.zeros((64, 10), np.float32)}")
            raise ElasticFlowError("model() returned no floating-point parameters to train", hint)
        # Parameter groups: the flat order keeps each group contiguous (model order without groups).
        self.groups = tf_optim.Groups(spec, list(named), owners(model, named),
                                      {id(v): n for n, v in named.items()} if self.native is not None else {})
        self.names = self.groups.order
        if self.native is None:
            self.shapes = [named[n].shape for n in self.names]
            self.targets = [tf.Variable(np.concatenate([named[n].reshape(-1) for n in self.names]))]
        else:
            self.targets = [named[n] for n in self.names]
            self.shapes = [tuple(int(d) for d in v.shape) for v in self.targets]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.num_params = int(np.sum(self.sizes))
        self.target_shapes = [tuple(int(d) for d in v.shape) for v in self.targets]
        self.target_sizes = [int(np.prod(s, dtype=np.int64)) for s in self.target_shapes]
        self.pieces: List[Any] = []  # a dict model's parameters as split in the step being traced (params)
        self._flat_copy = None  # flat_params()'s tensor, made at its first call

    def params(self, compute: Optional[tf.DType]):
        """What forward() receives: the native model, or a dict of views of the flat variable in ``compute``
        (None: float32). Called at trace time: the pieces it splits stay in ``pieces`` for the gradient step."""
        if self.native is not None:
            return self.native
        flat = tf.convert_to_tensor(self.targets[0])
        if compute is not None:  # one cast of the flat variable, not one per parameter
            flat = tf.cast(flat, compute)
        pieces = self.pieces = tf.split(flat, self.sizes)
        leaves = {n: tf.reshape(p, s) for n, p, s in zip(self.names, pieces, self.shapes)}
        leaves.update(self.buffers)
        return rebuild(self._tree, leaves)

    # -- by name, as numpy (backend-neutral checkpoints)
    def by_name(self, variables: List[Any], copy: bool = True) -> Dict[str, np.ndarray]:
        """Per-target variables (the parameters, or one optimizer slot's) as {parameter name: array};
        ``copy=False``: views."""
        arrays = [_view(v) for v in variables]
        if self.native is None:  # one flat variable holds them all, cut into shapes in order
            offsets = np.cumsum([0] + self.sizes).tolist()
            arrays = [arrays[0][offsets[i]:offsets[i + 1]].reshape(self.shapes[i]) for i in range(len(self.names))]
        return {n: a.copy() if copy else a for n, a in zip(self.names, arrays)}

    def assign_by_name(self, variables: List[Any], named: Dict[str, np.ndarray]) -> None:
        """``by_name`` backwards: assign ``named``'s arrays to the per-target variables."""
        if self.native is not None:
            for v, n, shape in zip(variables, self.names, self.shapes):
                v.assign(np.asarray(named[n]).astype(np_dtype(v)).reshape(shape))
        else:
            variables[0].assign(np.concatenate([np.asarray(named[n], np.float32).reshape(-1) for n in self.names]))

    def state(self, copy: bool = True) -> Dict[str, np.ndarray]:
        """Parameters, buffers and frozen weights by name (the optimizer's slots are the Engine's to add)."""
        out = self.by_name(self.targets, copy)
        out.update({n: _view(b).copy() if copy else _view(b) for n, b in {**self.buffers, **self.frozen}.items()})
        return out

    def load(self, state: Dict[str, np.ndarray]) -> None:
        """``state()`` backwards."""
        self.assign_by_name(self.targets, state)
        self.set_buffers({n: state[n] for n in [*self.buffers, *self.frozen]})

    # -- buffers (reconciled across workers: backends/buffers.py)
    def buffer_rules(self) -> Dict[str, Rule]:
        return {} if self.native is None else buffer_rules(self.native, self.buffers)

    def buffer_arrays(self) -> Dict[str, np.ndarray]:
        return {n: _view(v) for n, v in self.buffers.items()}

    def set_buffers(self, values: Dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            var = self.buffers[name] if name in self.buffers else self.frozen[name]  # a peer's frozen weights too
            var.assign(np.asarray(value).astype(np_dtype(var)).reshape(var.shape))

    # -- the flat parameters as torch sees them (sharded optimizer state: replica/shard.py)
    def flat_params(self):
        """The parameters as one flat float32 torch tensor, read from the variables now: a copy, the same
        tensor every call (a variable cannot be written through DLPack)."""
        import torch  # only the distributed path pays for torch under backend=tensorflow

        if self._flat_copy is None:
            self._flat_copy = torch.empty(self.num_params, dtype=torch.float32)
        np.concatenate([_view(v).reshape(-1) for v in self.targets], out=self._flat_copy.numpy())
        return self._flat_copy

    def params_written(self) -> None:
        """Assign ``flat_params()``'s tensor back to the variables (one assign per variable)."""
        flat = self._flat_copy.numpy()
        at = 0
        for v, size, shape in zip(self.targets, self.target_sizes, self.target_shapes):
            v.assign(flat[at:at + size].reshape(shape))
            at += size

    def layout(self) -> List[Tuple[str, Tuple[int, ...]]]:
        return list(zip(self.names, self.shapes))

"""The TensorFlow backend's devices and start-up: which GPUs TF sees, binding one, threads, seeds and
keras's dtype policy, all before anything starts TF's runtime or model() builds layers; and ``Precision``,
what the placement's precision changes in an Engine's steps (torch's engine takes it from ``torch.autocast``).

``gpus``, ``bf16_supported`` and ``setup`` are backend-package names: ``tensorflow/__init__.py`` exports them.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, List, Optional

import tensorflow as tf

from ...config.devices import Placement
from ...errors import ElasticFlowError
from . import data as tf_data
from .native import POLICIES, is_native, mixed_native
from .ops import _generator

_log = logging.getLogger("elasticflow")
_LOW = {"bfloat16": tf.bfloat16, "float16": tf.float16}


def gpus() -> List[str]:
    """Names of the GPUs this process sees ("NVIDIA H100 80GB HBM3"); [] on a CPU-only host or build.
    Listing physical devices does not start TF's runtime, so setup() can still choose among them."""
    return [tf.config.experimental.get_device_details(d).get("device_name", d.name)
            for d in tf.config.list_physical_devices("GPU")]


def bf16_supported() -> bool:
    """Whether the first visible GPU computes in bfloat16 (compute capability 8.0, Ampere, or newer);
    True without a GPU (TF's CPU kernels take bfloat16). A GPU that reports no capability counts as
    unable: refusing bf16 with a hint beats kernels that fail mid-run."""
    found = tf.config.list_physical_devices("GPU")
    if not found:
        return True
    capability = tf.config.experimental.get_device_details(found[0]).get("compute_capability")
    return capability is not None and tuple(capability) >= (8, 0)


def _bind_gpu(number: int) -> None:
    """Make GPU ``number`` the only one TF uses, growing its memory as needed (several workers may
    share a GPU under gloo, and one that grabbed all memory would starve the others)."""
    found = tf.config.list_physical_devices("GPU")
    if number >= len(found):
        raise ElasticFlowError(f"placement cuda:{number} but TensorFlow sees {len(found)} GPUs",
                               "check CUDA_VISIBLE_DEVICES, or pass trainer.device=cpu")
    try:
        tf.config.experimental.set_memory_growth(found[number], True)
        tf.config.set_visible_devices([found[number]], "GPU")
    except RuntimeError:
        # TF fixes its devices when its runtime starts: a second trainer in the same process keeps
        # the first one's, which is right only if they bound the same GPU.
        visible = [d.name for d in tf.config.get_visible_devices("GPU")]
        if visible != [found[number].name]:
            raise ElasticFlowError(
                f"TensorFlow started on {visible or 'the CPU'} before this trainer could bind {found[number].name}",
                "run one trainer per process on a GPU, or pass trainer.device=cpu") from None


def _keras_policy(precision: str) -> None:
    """Keras's global dtype policy for model() to build its layers with: mixed for bf16/16, else
    float32. Only set where needed: importing keras costs a dict model seconds."""
    if precision not in POLICIES and "keras" not in sys.modules:
        return
    import keras

    current = keras.config.dtype_policy().name
    wanted = POLICIES.get(precision, "float32")
    # float32 undoes only our own mixed policy (an earlier trainer's), not one the user chose.
    if current != wanted and (precision in POLICIES or current in POLICIES.values()):
        keras.config.set_dtype_policy(wanted)


def setup(threads: Optional[int], seed: int, placement: Placement = None, deterministic: bool = False) -> None:
    """Threads, seeds and the placement, before anything starts TF's runtime or model() builds layers.

    ``placement`` None: the CPU in float32. On a GPU only ``placement.index`` is made visible, so
    TF calls it "/GPU:0". ``deterministic`` (trainer.reproducible): TF's op determinism.
    """
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    placement = placement or Placement()
    if placement.kind == "cuda":
        _bind_gpu(placement.index or 0)
    tf_data.record(placement)
    _keras_policy(placement.precision)
    if threads:
        # inter-op 1: on a few cores, running independent graph ops side by side only
        # oversubscribes the intra-op pool that each matmul/conv already fills.
        for setter, want in ((tf.config.threading.set_intra_op_parallelism_threads, threads),
                             (tf.config.threading.set_inter_op_parallelism_threads, 1)):
            try:
                setter(want)
            except RuntimeError:
                # TF fixes its thread pools when it runs its first op; a second trainer in the
                # same process keeps the first one's pools.
                _log.debug("tensorflow already initialised; thread settings unchanged")
    tf.random.set_seed(seed)
    _generator().reset_from_seed(seed)


class Precision:
    """The compute dtype forward() runs in and the loss scale its backward runs on, for one Engine.

    Args:
        placement: the precision (``trainer.precision``) and whether it scales the loss (float16).
        model: what ``model(cfg)`` returned; a keras model is switched to keras's mixed policy here, before
            its variables are read.

    In bf16/16 the variables and slots stay float32. A dict model's parameters and the batch's float
    tensors are cast to the compute dtype inside the step (a cast's gradient is float32 again); a keras
    model computes under keras's mixed policy (its layers cast inputs and read variables in the low dtype).
    The loss enters the backward as float32, times the Engine's ``grad_scale`` (float16's loss scaling, set
    by the trainer): an overflow shows up as inf/nan in the gradient.
    """

    def __init__(self, placement: Placement, model: Any):
        self.compute: Optional[tf.DType] = _LOW.get(placement.compute_dtype)  # None: float32 throughout
        if is_native(model) and self.compute is not None:
            mixed_native(model, placement.precision)
        # The scale: a variable the compiled steps read, assigned only when it changes (dynamic loss scaling
        # changes it every few thousand steps), so it costs no argument per call and no retrace.
        # Compiled in only where used (``scaling``): float32's step stays the graph it was.
        self.scaling = placement.loss_scaling
        self._value = 1.0
        self._scale = tf.Variable(1.0, trainable=False)

    def set_scale(self, scale: float) -> bool:
        """Bring ``scale`` into the compiled steps (an eager assign, only when it changed); returns whether
        the steps must be traced again: the first scale outside float16 compiles the scaling in, once."""
        if scale == self._value:
            return False
        retrace = not self.scaling
        self.scaling = True
        self._scale.assign(scale)
        self._value = scale
        return retrace

    def scaled(self, loss: tf.Tensor) -> tf.Tensor:
        """At trace time: what the backward runs on."""
        return loss * tf.convert_to_tensor(self._scale) if self.scaling else loss

    def inputs(self, batch: tuple) -> tuple:
        """A dict model's batch with its float tensors in the compute dtype (keras casts a layer's inputs
        itself, so a native model's batch, a float target included, is left as it is)."""
        return tuple(tf.cast(t, self.compute) if tf.is_tensor(t) and t.dtype.is_floating else t for t in batch)

"""``elasticflow.ops``, the backend-neutral ops a model file calls: the public name of ``elasticflow.train.ops``.

The module lives in the train layer; this file only makes ``import elasticflow.ops`` and
``from elasticflow import ops`` give that same module object (so ``ops.use("tensorflow")`` and a test's
monkeypatch act on the one the trainer uses). Inside elasticflow/, import ``elasticflow.train.ops``.
"""
import sys

from .train import ops as _ops

sys.modules[__name__] = _ops

"""``elasticflow.optim``, the optimizer specs and learning-rate schedules a model file may return: the public name
of ``elasticflow.config.optim``.

The module lives in the config layer (replica/ and train/ read its specs); this file only makes
``import elasticflow.optim`` and ``from elasticflow import optim`` give that same module object. Inside
elasticflow/, import ``elasticflow.config.optim``.
"""
import sys

from .config import optim as _optim

sys.modules[__name__] = _optim

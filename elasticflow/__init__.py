"""ElasticFlow: write model(), forward() and data(); the framework trains it.

Public names: ``fit`` (train functions or a module of them, as ``elasticflow train`` does), ``ElasticTrainer``, ``CheckpointInterval``, ``context``, ``export`` (a checkpoint's weights in
the model's own framework form), ``Callback`` and the built-in ``EarlyStopping``, ``BestCheckpoints`` and
``LearningRateMonitor`` (train/callbacks.py), and the modules ``ops``,
``optim``, ``checkpoint`` and ``data`` (dataset forms, per-sample seeds). Heavy imports (torch, TensorFlow) happen only when a backend is used.
"""
__version__ = "0.1.0"

__all__ = ["fit", "ElasticTrainer", "CheckpointInterval", "context", "export", "Callback", "EarlyStopping", "BestCheckpoints",
           "LearningRateMonitor", "ops", "optim", "checkpoint", "data"]
CALLBACKS = ("Callback", "EarlyStopping", "BestCheckpoints", "LearningRateMonitor")


def __getattr__(name):
    # Lazy: `import elasticflow` must not import a backend or Hydra.
    if name == "ElasticTrainer":
        from .trainer import ElasticTrainer

        return ElasticTrainer
    if name == "CheckpointInterval":
        from .checkpoint import CheckpointInterval

        return CheckpointInterval
    if name == "context":
        from ._util.context import context

        return context
    if name == "export":
        from .exporting import export

        return export
    if name == "fit":
        from .fitting import fit

        return fit
    if name in CALLBACKS:
        from .train import callbacks

        return getattr(callbacks, name)
    if name in ("ops", "optim", "checkpoint", "data"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'elasticflow' has no attribute {name!r}")

"""Load the user's model file and check its contract: model(), forward(*batch, params), data().

Every mistake becomes one ElasticFlowError naming the file, what was expected and how to fix it.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

from ..config import optim
from ..errors import ElasticFlowError

CONTRACT_HINT = ("a model file defines model(cfg), forward(*batch, params) (the last argument receives the model, "
                 "whatever its name) and data(cfg); see models/linear.py")


@dataclass
class ModelFile:
    path: Path
    model: Callable[..., Any]
    forward: Callable[..., Any]
    data: Callable[..., Any]
    eval_data: Optional[Callable[..., Any]]
    callbacks: Optional[Callable[..., Any]] = None  # callbacks(cfg): a list of elasticflow.Callback (optional)
    collate: Optional[Callable[..., Any]] = None    # collate(samples): one micro-batch from its samples (optional)

    def call(self, name: str, cfg: Any) -> Any:
        """Call model/data/eval_data/callbacks with cfg when the function takes an argument, else without."""
        fn = getattr(self, name)
        try:
            takes_cfg = len(inspect.signature(fn).parameters) > 0
        except (TypeError, ValueError):
            takes_cfg = True
        return fn(cfg) if takes_cfg else fn()

    def check_eval(self, eval_every: Optional[int]) -> None:
        """Refuse trainer.eval_every without eval_data() at start: it was silently ignored."""
        if eval_every and self.eval_data is None:
            raise ElasticFlowError(f"trainer.eval_every={eval_every} is set, but model file '{self.path}' defines "
                                   "no eval_data() to evaluate on",
                                   "define eval_data(cfg), returning held-out data in data()'s form, or drop "
                                   "trainer.eval_every")

    def field_names(self) -> Optional[List[str]]:
        """forward()'s data parameters by name (the model's left out), or None where it takes ``*batch``: a
        collate's dict then reaches forward() by name, whatever its keys' order."""
        try:
            parameters = list(inspect.signature(self.forward).parameters.values())
        except (TypeError, ValueError):
            return None
        if any(p.kind == p.VAR_POSITIONAL for p in parameters):
            return None
        by_name = any(p.name == "params" and p.kind == p.KEYWORD_ONLY for p in parameters)
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return names if by_name else names[:-1]

    def check_fields(self, fields: int, what: str = "data()") -> None:
        """Raise when forward() cannot take a batch of ``fields`` arrays (what ``what`` yields per sample)
        and the model, as the engines call it: otherwise the call fails inside the framework as a bare
        TypeError that names neither forward() nor the data."""
        try:
            signature = inspect.signature(self.forward)  # the user's own: _model_argument's wrapper keeps it
        except (TypeError, ValueError):
            return
        parameters = signature.parameters.values()
        by_name = any(p.name == "params" and p.kind == p.KEYWORD_ONLY for p in parameters) or \
            any(p.kind == p.VAR_KEYWORD for p in parameters)
        fields_given = [object()] * fields
        try:
            signature.bind(*fields_given, params=None) if by_name else signature.bind(*fields_given, None)
        except TypeError:
            takes = [p.name for p in parameters]
            data_params = len([p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                               and p.default is p.empty]) - (0 if by_name else 1)
            raise ElasticFlowError(
                f"forward({', '.join(takes)}) in '{self.path}' takes {max(data_params, 0)} data field(s) and the "
                f"model, but {what} yields {fields} field(s) per sample",
                f"give forward() one parameter per field of {what} (in its order) and the model last, e.g. "
                f"def forward({', '.join(f'x{i}' for i in range(fields)) or 'x'}, params)") from None


def _read_source(file: Path) -> bytes:
    """The bytes of the model file ``file`` (resolved), opened with ``O_NOFOLLOW``."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ElasticFlowError(f"model file '{file}' cannot be read ({exc.strerror})",
                               "pass the path to a Python file you may read") from exc
    with os.fdopen(fd, "rb") as f:
        return f.read()


def load(path: str) -> ModelFile:
    """Import ``path`` as a module (under a private name) and check the three functions."""
    file = Path(path).expanduser()
    if not file.is_file():
        where = "a directory" if file.is_dir() else "not found"
        raise ElasticFlowError(f"model file '{path}' is {where}",
                               "pass the path to a Python file, e.g. elasticflow train models/digits_mlp.py")
    if file.suffix != ".py":
        raise ElasticFlowError(f"model file '{path}' is not a .py file", CONTRACT_HINT)
    file = file.resolve()
    module_name = f"elasticflow_user_model_{abs(hash(str(file)))}"
    # The source is read once, through one descriptor that follows no symlink, and that text is what runs: a
    # file swapped after the checks (launchers' folder checks, is_file above) or a .pyc planted in its
    # __pycache__ is never what is imported.
    source = _read_source(file)
    spec = importlib.util.spec_from_loader(module_name, loader=None, origin=str(file))
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(file)
    # The model file may import helpers that sit beside it.
    sys.path.insert(0, str(file.parent))
    sys.modules[module_name] = module
    try:
        exec(compile(source, str(file), "exec", dont_inherit=True), module.__dict__)  # noqa: S102 - the import
    except SyntaxError as exc:
        raise ElasticFlowError(f"model file '{path}' has a syntax error at line {exc.lineno}: {exc.msg}",
                               "fix the file; `python -m py_compile FILE` shows the same error") from exc
    except ImportError as exc:
        raise ElasticFlowError(f"model file '{path}' failed to import: {exc}",
                               "install the missing package into .venv or fix the import") from exc
    finally:
        sys.path.remove(str(file.parent))

    functions = {}
    for name in ("model", "forward", "data"):
        fn = getattr(module, name, None)
        if fn is None:
            raise ElasticFlowError(f"model file '{path}' has no {name}() function", CONTRACT_HINT)
        if not callable(fn):
            raise ElasticFlowError(f"'{name}' in model file '{path}' is a {type(fn).__name__}, not a function",
                                   CONTRACT_HINT)
        functions[name] = fn
    optional = {}
    for name in ("eval_data", "callbacks", "collate"):
        fn = optional[name] = getattr(module, name, None)
        if fn is not None and not callable(fn):
            raise ElasticFlowError(f"'{name}' in model file '{path}' is not a function", CONTRACT_HINT)
    functions["forward"] = _model_argument(functions["forward"], path)
    return ModelFile(path=file, **optional, **functions)


# What users call the model's parameter (Lightning's and HF's habits): a forward() that takes one of these
# first, and a field last, has the model in the wrong place.
MODEL_NAMES = ("model", "net", "params", "module", "network")


def _scheduler(entry: Any) -> Any:
    """model()'s ``"lr_scheduler"``: a scheduler, or Lightning's ``{"scheduler": s, "interval": "step"}``. It is
    stepped once per optimizer step; Lightning's default interval, an epoch, is refused rather than changed."""
    if not isinstance(entry, dict):
        return entry
    if "scheduler" not in entry:
        raise ElasticFlowError("model()['lr_scheduler'] is a dict without a 'scheduler'",
                               "return {'scheduler': sched, 'interval': 'step'} (Lightning's form) or the scheduler")
    interval, frequency = entry.get("interval", "epoch"), entry.get("frequency", 1)
    if interval != "step" or frequency != 1:
        said = f"interval={interval!r}" + ("" if "interval" in entry else " (Lightning's default)")
        raise ElasticFlowError(f"model()['lr_scheduler'] asks for {said}, frequency={frequency}: ElasticFlow steps "
                               "a scheduler once per optimizer step",
                               "return {'scheduler': sched, 'interval': 'step'} with its length counted in "
                               "optimizer steps (trainer.max_steps, or steps per epoch x epochs)")
    return entry["scheduler"]


def _model_argument(forward: Callable[..., Any], path: str) -> Callable[..., Any]:
    """forward() as the engines call it, ``forward(*batch, params=model)``, whatever the user named the
    model's parameter: a keyword-only ``params`` (``def forward(*batch, params)``) takes it by name,
    otherwise the last positional parameter does (``forward(x, y, net)``, ``forward(ids, model)``)."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: trust it takes params by name
        return forward
    if any(p.name == "params" and p.kind == p.KEYWORD_ONLY for p in parameters) or \
            any(p.kind == p.VAR_KEYWORD for p in parameters):
        return forward
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if not positional:
        raise ElasticFlowError(f"forward() in '{path}' takes no argument for the model",
                               "declare it as def forward(x, y, params): the last argument receives the "
                               "parameters (or the native model) that model() returned")
    names = [p.name for p in positional if p.kind != p.VAR_POSITIONAL]
    if len(names) > 1 and names[0] in MODEL_NAMES and names[-1] not in MODEL_NAMES:
        # forward(net, x, y) would receive a batch field as the model: "'Tensor' object is not callable".
        order = ", ".join([*names[1:], names[0]])
        raise ElasticFlowError(f"forward({', '.join(names)}) in '{path}' takes the model first",
                               f"the model comes last, after the data fields: def forward({order})")

    @functools.wraps(forward)
    def by_position(*batch, params):
        return forward(*batch, params)
    return by_position


@dataclass
class Built:
    """What ``model(cfg)`` returned, checked: the model (a dict of arrays or a native model) and its optimizer."""
    model: Any
    optimizer: optim.OptimizerSpec
    optimizer_from_model: bool  # model() returned an "optimizer" entry (it wins over the config group)


# The keys of the config's optimizer group that model()'s own optimizer replaces (not the schedule's: the config's
# schedule drives model()'s optimizer too), and what a group's file leaves them at when the run does not say.
_REPLACED = {"lr": None, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8,
             "no_decay": [], "groups": []}


def _refuse_unused(group: Any) -> None:
    """Refuse the config's optimizer settings that model()'s own optimizer would leave unused (a run with another
    optimizer than the one asked for). An optimizer group other than the default sgd is one setting; within a
    group, each key set away from the group's file."""
    from omegaconf import OmegaConf

    from .._util.paths import conf_dir

    name = str(group.get("name", "sgd"))
    if name != "sgd":
        said = [f"optimizer={name}"]
    else:
        chosen = OmegaConf.to_container(group, resolve=True)
        file = OmegaConf.to_container(OmegaConf.load(conf_dir() / "optimizer" / "sgd.yaml"))
        said = [f"optimizer.{key}={chosen.get(key)}" for key, default in _REPLACED.items()
                if chosen.get(key) != file.get(key, default)]
    if said:
        raise ElasticFlowError(f"model() returns its own optimizer, so {', '.join(said)} would not be used",
                               "set them on the optimizer model() returns (its lr, its param_groups), or drop "
                               "model()'s optimizer to train with the config's; optimizer.schedule applies to either")


def build(model_file: ModelFile, cfg: Any, backend: Any) -> Built:
    """Call ``model(cfg)`` and check what it returned against ``backend`` (the backend module).

    The optimizer is the config group's, or the one model() gives (under ``"optimizer"``, or a keras model's
    compiled one), with its scheduler (``"lr_scheduler"``, as Lightning's ``configure_optimizers`` returns it,
    or a keras ``LearningRateSchedule``). The config's ``optimizer.schedule`` drives a model()'s optimizer that
    has no schedule of its own; two schedules, or one that will not be applied, are refused in one line."""
    built = model_file.call("model", cfg)
    config_spec = optim.from_config(cfg.optimizer)
    spec = config_spec
    from_model = isinstance(built, dict) and "optimizer" in built
    scheduler = None
    if isinstance(built, dict) and "lr_scheduler" in built:
        built = dict(built)
        scheduler = _scheduler(built.pop("lr_scheduler"))
        if not from_model:
            raise ElasticFlowError("model() returns an 'lr_scheduler' without the 'optimizer' it steps",
                                   "return both, {'optimizer': opt, 'lr_scheduler': sched}, or drop the scheduler "
                                   "and set optimizer.schedule in the config")
    if from_model:
        built = dict(built)
        spec = built.pop("optimizer")
        if not isinstance(spec, optim.OptimizerSpec) or scheduler is not None:
            # a torch.optim optimizer built on the model's groups (and its scheduler), or a keras one
            native = backend.spec_from_native(spec, scheduler)
            if native is None:
                raise ElasticFlowError(f"model()['optimizer'] is a {type(spec).__name__}, not an optimizer spec",
                                       "use elasticflow.optim.SGD(lr), Adam(lr) or AdamW(lr), or a torch.optim "
                                       "(torch) or keras.optimizers (tensorflow) SGD, Adam or AdamW")
            spec = native
    elif backend.is_native(built):
        compiled = backend.spec_from_native(built)  # a keras model compiled with an optimizer trains with it
        if compiled is not None:
            spec, from_model = compiled, True
    if from_model:  # the config's schedule drives model()'s optimizer too, or is refused beside another
        _refuse_unused(cfg.optimizer)
        spec = optim.with_schedule(spec, config_spec.schedule)
    foreign = backend.native_kind(built)
    if foreign:
        raise ElasticFlowError(f"model() returned {foreign}, which backend={backend.NAME} cannot train",
                               "run it with the backend it was written for, or return a dict of arrays "
                               "to run on every backend")
    if isinstance(built, dict) and not backend.modules_only(built):
        held = [k for k, v in built.items() if backend.is_native(v)]
        if held and backend.modules_only({held[0]: built[held[0]]}):  # torch: a dict of modules only
            raise ElasticFlowError(f"model() returned a dict that mixes a {backend.NAME} model ({held[0]!r}) with "
                                   "other entries", "return modules only (arrays as their parameters or buffers), "
                                   "or a dict of arrays")
        if held:  # the torch habit ({"net": module}); TensorFlow trains one keras model or a dict of arrays
            raise ElasticFlowError(f"model() returned a dict holding a {backend.NAME} model under {held[0]!r}, "
                                   f"which backend={backend.NAME} cannot train inside a dict",
                                   "return the model itself (forward() then receives it) and its optimizer with "
                                   "model.compile(optimizer=...), or a dict of arrays")
    if not isinstance(built, dict) and not backend.is_native(built):
        raise ElasticFlowError(f"model() returned a {type(built).__name__}; expected a dict of named parameters "
                               f"or a native {backend.NAME} model", "return e.g. {'W': np.zeros((4, 2))}")
    return Built(built, spec, from_model)

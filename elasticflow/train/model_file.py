"""Load the user's model file and check its contract: model(), forward(*batch, params), data().

Every mistake becomes one ElasticFlowError naming the file, what was expected and how to fix it.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

from .. import optim
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
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    # The model file may import helpers that sit beside it.
    sys.path.insert(0, str(file.parent))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
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


def build(model_file: ModelFile, cfg: Any, backend: Any) -> Built:
    """Call ``model(cfg)`` and check what it returned against ``backend`` (the backend module)."""
    built = model_file.call("model", cfg)
    spec = optim.from_config(cfg.optimizer)
    from_model = isinstance(built, dict) and "optimizer" in built
    if from_model:
        built = dict(built)
        spec = built.pop("optimizer")
        if not isinstance(spec, optim.OptimizerSpec):
            native = backend.spec_from_native(spec)  # a torch.optim optimizer built on the model's groups
            if native is None:
                raise ElasticFlowError(f"model()['optimizer'] is a {type(spec).__name__}, not an optimizer spec",
                                       "use elasticflow.optim.SGD(lr), Adam(lr) or AdamW(lr), or a torch.optim "
                                       "(torch) or keras.optimizers (tensorflow) SGD, Adam or AdamW")
            spec = native
    elif backend.is_native(built):
        compiled = backend.spec_from_native(built)  # a keras model compiled with an optimizer trains with it
        if compiled is not None:
            spec, from_model = compiled, True
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

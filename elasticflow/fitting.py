"""``elasticflow.fit()``: the Python API. It trains functions (or a module holding them) exactly as
``elasticflow train`` trains a model file, with any number of workers, and returns what the run's ``done:``
line says.

Worker processes cannot receive a function object: each imports what it trains. So ``fit()`` writes a small
model file into the run directory that imports every function by its module and qualified name, and runs the
CLI's ``train`` on it in this process (Hydra's config, validation, console and ``train.log``, the launchers).
A lambda or a function defined inside another one has no name to import by, and is refused in one line.
A function defined in the script being run (``__main__``) is imported from that script's file under another
name; as with ``multiprocessing``, the script must call ``fit()`` under ``if __name__ == "__main__":``.
"""
from __future__ import annotations

import json
import re
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ._util.fileio import write_atomic
from .errors import ElasticFlowError

FUNCTIONS = ("model", "forward", "data", "eval_data", "callbacks")
REQUIRED = ("model", "forward", "data")
RESULT = "result.json"  # RUN_DIR/result.json: what the run's `done:` line says (launchers/exits.py writes it)


def fit(source: Optional[types.ModuleType] = None, *, model: Optional[Callable] = None,
        forward: Optional[Callable] = None, data: Optional[Callable] = None, eval_data: Optional[Callable] = None,
        callbacks: Optional[Callable] = None, overrides: Sequence[str] = (),
        config: Optional[Mapping[str, Any]] = None, run_dir: Optional[str] = None) -> Dict[str, Any]:
    """Train ``model``, ``forward`` and ``data`` (or the module ``source`` that defines them); the run's result.

    Args:
        source: a module defining ``model(cfg)``, ``forward(*batch, params)``, ``data(cfg)`` and optionally
            ``eval_data(cfg)`` and ``callbacks(cfg)``; functions given by keyword replace its own.
        overrides: config overrides, as on the command line (``["launcher.workers=3", "optimizer=adam"]``).
        config: the same as a dict, nested or with dotted keys (``{"trainer": {"max_steps": 100},
            "launcher.workers": 3, "optimizer.groups": [{"params": ["head"], "lr": 0.01}]}``); applied after
            ``overrides``.
        run_dir: where the run writes (default ``runs/fit-<date>-<time>``); rerunning into it resumes.
            ``hydra.run.dir=DIR`` among the overrides means the same.

    Returns:
        What ``elasticflow train`` prints on its ``done:`` line: ``step``, ``loss``, ``checkpoint``, the eval
        metrics, ``stopped_early``/``best_checkpoint`` where callbacks set them.

    Example:
        >>> import my_model            # a module of yours: model(cfg), forward(x, y, params), data(cfg)
        >>> result = elasticflow.fit(my_model, overrides=["trainer.max_steps=100", "launcher.workers=3"])
        >>> elasticflow.fit(model=my_model.model, forward=my_model.forward, data=my_model.data)

    Note:
        Raises ``ElasticFlowError`` when the run fails (its one-line error was printed, as by the CLI).
    """
    given = {name: fn for name, fn in (("model", model), ("forward", forward), ("data", data),
                                       ("eval_data", eval_data), ("callbacks", callbacks)) if fn is not None}
    if source is not None:
        if not isinstance(source, types.ModuleType):
            raise ElasticFlowError(f"fit() takes a module or functions, got a {type(source).__name__}",
                                   "pass fit(my_module) or fit(model=..., forward=..., data=...)")
        given = {**{n: getattr(source, n) for n in FUNCTIONS if callable(getattr(source, n, None))}, **given}
    missing = [n for n in REQUIRED if n not in given]
    if missing:
        raise ElasticFlowError(f"fit() needs {', '.join(missing)}", "pass model=, forward= and data= (functions "
                               "as in a model file: docs/model-file.md), or a module that defines them")
    overrides = [*overrides, *config_overrides(config or {})]
    run_dir, overrides = _run_dir(run_dir, overrides)
    run = Path(run_dir or f"runs/fit-{time.strftime('%Y%m%d-%H%M%S')}").expanduser().resolve()
    run.mkdir(parents=True, exist_ok=True)
    path = run / "model_file.py"
    write_atomic(path, model_file_text(given))
    (run / RESULT).unlink(missing_ok=True)
    if not any(o.lstrip("+").startswith("checkpoint.job_name=") for o in overrides):
        # checkpoints named after what trains (my_model_<date>), not after the file written here (model_file_...)
        overrides.insert(0, f"checkpoint.job_name={_job_name(source, given)}")
    _train([str(path), f"hydra.run.dir={run}", *overrides])
    try:
        return json.loads((run / RESULT).read_text())
    except (OSError, ValueError):
        raise ElasticFlowError(f"the run in {run} ended without a result", "read its train.log") from None


def config_overrides(config: Mapping[str, Any], prefix: str = "") -> List[str]:
    """``config`` (nested dicts and/or dotted keys) as command-line overrides, in Hydra's override grammar.
    A dict is a section (its keys join the name with dots); a list of dicts is a value (``optimizer.groups``).
    ``model_args``' keys are the model file's own: added with ``++`` (added, or replaced if set)."""
    if not isinstance(config, Mapping):
        raise ElasticFlowError(f"fit(config=...) takes a dict, got a {type(config).__name__}",
                               'pass e.g. config={"trainer": {"max_steps": 100}, "launcher.workers": 3}')
    out = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out += config_overrides(value, f"{name}.")
        else:
            added = "++" if name.startswith("model_args.") else ""
            out.append(f"{added}{name}={_value(value)}")
    return out


def _value(value: Any) -> str:
    """One value in Hydra's override grammar: true/false/null, numbers, [lists], {dicts}, strings quoted when
    they hold anything but plain characters."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[A-Za-z0-9_./:*+-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _run_dir(run_dir: Optional[str], overrides: List[str]) -> tuple:
    """``run_dir``, or the ``hydra.run.dir=`` among ``overrides`` (taken out of them: fit() passes its own)."""
    given = [o for o in overrides if o.lstrip("+").startswith("hydra.run.dir=")]
    rest = [o for o in overrides if o not in given]
    dirs = {o.split("=", 1)[1] for o in given}
    if run_dir is not None:
        dirs.add(str(run_dir))
    if len(dirs) > 1:
        raise ElasticFlowError(f"fit() was given two run directories: {', '.join(sorted(dirs))}",
                               "pass one, as run_dir=DIR (hydra.run.dir=DIR among the overrides means the same)")
    return (dirs.pop() if dirs else None), rest


def _job_name(source: Optional[types.ModuleType], given: Dict[str, Callable]) -> str:
    """What the checkpoints are named after: the module trained (a script: its file's name)."""
    module = source.__name__ if source is not None else getattr(given["model"], "__module__", "") or ""
    if module == "__main__":
        module = Path(getattr(sys.modules.get("__main__"), "__file__", None) or "fit").stem
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", module.rpartition(".")[2]).strip(".") or "fit"
    return name


def model_file_text(functions: Dict[str, Callable]) -> str:
    """A model file that imports each of ``functions`` by its module and qualified name."""
    lines = ['"""Written by elasticflow.fit(): the functions it was given, imported by name, so that every worker',
             'trains the same ones. `elasticflow train` trains this file as any other."""',
             "import importlib", "import importlib.util", "import sys", "", "",
             "def _imported(module, root, file):",
             "    if file:  # the script fit() was called from (__main__), under a name of its own",
             "        if module not in sys.modules:",
             "            spec = importlib.util.spec_from_file_location(module, file)",
             "            sys.modules[module] = importlib.util.module_from_spec(spec)",
             "            spec.loader.exec_module(sys.modules[module])",
             "        return sys.modules[module]",
             "    if root and root not in sys.path:",
             "        sys.path.insert(0, root)",
             "    return importlib.import_module(module)", "", ""]
    for name, fn in functions.items():
        module, root, file = _where(name, fn)
        lines.append(f"{name} = _imported({module!r}, {root!r}, {file!r}).{fn.__qualname__}")
    return "\n".join(lines) + "\n"


def _where(name: str, fn: Any) -> tuple:
    """(module name, the sys.path entry it imports from, the file of a __main__ script) for ``fn``."""
    if not callable(fn):
        raise ElasticFlowError(f"fit(): {name} is a {type(fn).__name__}, not a function",
                               f"pass {name}= a function as in a model file (docs/model-file.md)")
    qualname, module = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
    if not qualname or not module or "<lambda>" in qualname or "<locals>" in qualname:
        raise ElasticFlowError(f"fit(): {name} is {'a lambda' if qualname and '<lambda>' in qualname else 'a closure'}"
                               f" ({module}.{qualname}), which worker processes cannot import by name",
                               f"define {name} with `def` at the top level of a module (or of your script)")
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if module == "__main__":
        if not file:
            raise ElasticFlowError(f"fit(): {name} is defined in an interactive session, which worker processes "
                                   "cannot import", f"define {name} in a .py file and import it from there")
        return "elasticflow_fit_main", None, str(Path(file).resolve())
    if not file:
        return module, None, None  # a built-in or namespace module: importable as it is
    root = Path(file).resolve().parent
    for _ in range(module.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    return module, str(root), None


def _train(args: Sequence[str]) -> None:
    """``elasticflow train ARGS`` in this process; SystemExit (the CLI's failure) becomes ElasticFlowError."""
    from hydra.core.global_hydra import GlobalHydra

    from .cli import main

    argv = list(sys.argv)
    try:
        main(["train", *args])
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ElasticFlowError(f"training failed (exit {exc.code}); its error is printed above",
                                   "fix what it says and call fit() again: the run resumes from its "
                                   "checkpoint") from None
    finally:
        sys.argv[:] = argv
        GlobalHydra.instance().clear()

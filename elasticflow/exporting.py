"""`elasticflow export CHECKPOINT --to DIR`: a checkpoint's weights in the model's own framework form.

A checkpoint holds tensors by the Engine's names (parameters, stateful buffers, optimizer slots), which
are not what the framework's loaders read: a torch ``state_dict`` also lists tied aliases, a keras model
reads an ``.h5`` file. Export rebuilds the model the run trained -- its model file's ``model()`` under the
run's config (``RUN_DIR/.hydra/overrides.yaml``, read only from a run directory of yours, or ``--model`` and
overrides) --, loads the checkpoint into it through the backend's Engine (the one authority on names, so
export follows its naming) and writes the model as its framework saves it:

    torch nn.Module     model.safetensors: every state_dict() key (tied aliases as copies, non-persistent
                        buffers absent): ``net.load_state_dict(load_file(...), strict=True)``
    transformers model  save_pretrained(): config.json + model.safetensors (every state_dict key, as above):
                        ``TheClass.from_pretrained(DIR)`` and the strict load both work
    keras model         model.weights.h5 (``save_weights``): ``net.load_weights(DIR / "model.weights.h5")``;
                        one on KERAS_BACKEND=torch (trained by backend=torch: a torch module too) as well
    tf.Module           model.index + model.data-*: ``tf.train.Checkpoint(model=net).read(DIR / "model")``
    peft model          adapter_config.json + adapter_model.safetensors (``PeftModel.from_pretrained(base,
                        DIR)``), and merged/: the base model with the adapter merged in, in its own form
    dict of arrays      model.safetensors of the arrays by name (nested keys joined with "/")

``model()`` returning ``{"net": module, "optimizer": ...}`` exports ``module`` with its own keys, and
``torch.compile(net)`` exports ``net``'s.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .train import model_file
from .train import ops
from .checkpoint.format import HINT_PATH, METADATA, read_metadata, resolve
from .checkpoint.validate import check_metadata
from .checkpoint.load import compare_names, load
from .config.schema import composed, refuse_renamed, validate
from .errors import ElasticFlowError

WEIGHTS = "model.safetensors"
KERAS_WEIGHTS = "model.weights.h5"  # keras 3 refuses save_weights to a name without this suffix
RUN_OVERRIDES = Path(".hydra") / "overrides.yaml"
HINT_MODEL = "pass the model file and the overrides it trained with: --model MODEL.py [key=value ...]"


@dataclass
class Exported:
    """What ``export`` wrote: ``path`` (the directory), the checkpoint and its step, the form, the files."""
    path: Path
    checkpoint: Path
    step: int
    form: str
    files: List[str]

    def describe(self) -> str:
        return (f"exported step {self.step} of {self.checkpoint} to {self.path}: {self.form} "
                f"({', '.join(self.files)})")


def export(checkpoint: str | Path, to: str | Path, model: Optional[str] = None,
           overrides: Optional[Sequence[str]] = None, best: bool = False) -> Exported:
    """Write the weights of ``checkpoint`` into the new directory ``to``, in the model's own framework form.

    Args:
        checkpoint: a checkpoint directory, or a job dir, ``checkpoint.dir`` or run dir (its newest checkpoint).
        model: the model file; default: the one the run recorded in ``RUN_DIR/.hydra/overrides.yaml``.
        overrides: ``key=value`` config overrides on top of the run's (``model_args`` shape the model).
        best: export the best checkpoint by ``checkpoint.monitor`` (the best-k the run kept, as its newest
            checkpoint records them) instead of the newest.

    Example:
        >>> elasticflow.export("outputs/2026-11-26/10-00-00", "exported/bert")
        >>> net.load_state_dict(safetensors.torch.load_file("exported/bert/model.safetensors"), strict=True)

    Note: the weights are the float32 values the run trained, on the CPU. A keras model's variable names
    follow its layer names: name layers by hand (keras numbers unnamed ones per process). A transformers
    model large enough for ``save_pretrained`` to shard keeps its shards (and their index) as written.
    """
    path = _checkpoint(Path(checkpoint).expanduser())
    if best:
        path = best_of(path)
    to = _target(Path(to).expanduser())
    meta = read_metadata(path)
    check_metadata(path, meta)  # a crafted metadata.json is one error line here too, before anything is read
    cfg = run_config(path, model, list(overrides or []))
    tmp = to.parent / f".{to.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    try:
        form = _export_into(path, cfg, tmp, {"elasticflow_checkpoint": str(path), "step": str(meta["step"])})
        if to.exists():
            to.rmdir()  # empty (checked above): replaced whole, so a failed export leaves nothing half-written
        tmp.rename(to)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(to, path, int(meta["step"]), form, sorted(os.listdir(to)))


# ---------------------------------------------------------------- the checkpoint, the target, the config
def _checkpoint(path: Path) -> Path:
    if not path.exists():
        raise ElasticFlowError(f"checkpoint '{path}' does not exist", HINT_PATH)
    found = resolve(path)  # a checkpoint, or the newest under a job, checkpoint or run directory
    if not (found / METADATA).exists():
        raise ElasticFlowError(f"'{path}' is not a checkpoint: no {METADATA} in it and no complete checkpoint "
                               "under it", HINT_PATH + " (or a run directory)")
    return found.resolve()  # absolute: its run directory is searched for above it


def best_of(newest: Path) -> Path:
    """The best checkpoint by ``checkpoint.monitor`` beside ``newest``: the first of the best-k list its
    metadata records (train/callbacks.py's BestCheckpoints state: ``[[value, step], ...]``, best first)."""
    meta = read_metadata(newest)
    check_metadata(newest, meta)
    kept = [v for k, v in (meta.get("callbacks") or {}).items() if k.endswith(":BestCheckpoints")]
    ranked = kept[0].get("best") if kept and isinstance(kept[0], dict) else None
    if not ranked:
        raise ElasticFlowError(f"--best: {newest} records no best checkpoint (the run ranked none)",
                               "train with checkpoint.monitor=METRIC (and trainer.eval_every=N) to keep the best, "
                               "or export a checkpoint by its path")
    value, step = ranked[0]
    found = newest.parent / f"step_{int(step)}"
    if not (found / METADATA).exists():
        raise ElasticFlowError(f"--best: the best checkpoint, step {int(step)} ({value:g}), is not in "
                               f"{newest.parent}", "it was deleted or never committed: export one by its path")
    return found.resolve()


def _target(to: Path) -> Path:
    if to.exists() and not to.is_dir():
        raise ElasticFlowError(f"--to '{to}' is a file", "pass a new or empty directory for the exported weights")
    if to.is_dir() and any(to.iterdir()):
        raise ElasticFlowError(f"--to '{to}' exists and is not empty",
                               "pass a new or empty directory: export never overwrites files")
    return to.resolve()


def _key(override: str) -> str:
    return override.lstrip("~+").split("=", 1)[0]


def recorded_overrides(checkpoint: Path) -> Optional[List[str]]:
    """The overrides of the run that wrote ``checkpoint`` (its run dir's ``.hydra/overrides.yaml``: the
    model file and every key=value given to ``elasticflow train``), or None when none of yours is found above
    it (``_run_of``)."""
    found, _ = _run_of(checkpoint)
    return None if found is None else found[1]


def _run_of(checkpoint: Path) -> Tuple[Optional[Tuple[Path, List[str]]], str]:
    """((run dir, its overrides), "") of the run that wrote ``checkpoint``, or (None, why none was read).

    The run dir is the nearest of the checkpoint and its 4 parents (step -> job -> checkpoint.dir -> run dir)
    with a ``.hydra/overrides.yaml``, within the run: the search stops at the first folder that is not yours
    alone. With ``checkpoint.dir=/tmp/x`` anyone may create ``/tmp/.hydra/overrides.yaml``, naming a model file
    of theirs that export would import as you. The file is read through descriptors (``read_beneath``):
    ``.hydra/`` and the file must be yours and nobody else's to write, and a symlink is not followed."""
    from omegaconf import ListConfig, OmegaConf

    from ._util.paths import not_only_yours, read_beneath

    searched = [checkpoint, *list(checkpoint.parents)[:4]]
    for i, directory in enumerate(searched):
        problem = not_only_yours(directory)
        if problem:  # the run ends here: what lies above is someone else's
            planted = next((d / RUN_OVERRIDES for d in searched[i:] if os.path.lexists(d / RUN_OVERRIDES)), None)
            return None, f"; {planted} is not read: {directory} {problem}" if planted else ""
        if not os.path.lexists(directory / RUN_OVERRIDES):
            continue
        text = read_beneath(directory, RUN_OVERRIDES.parts)
        try:
            overrides = OmegaConf.create(text.decode())
        except Exception as exc:  # noqa: BLE001 - a broken file is one line, whatever yaml raised
            raise ElasticFlowError(f"{directory / RUN_OVERRIDES} is not YAML: {str(exc).splitlines()[0]}",
                                   HINT_MODEL) from None
        if not isinstance(overrides, ListConfig):
            raise ElasticFlowError(f"{directory / RUN_OVERRIDES} is not a list of overrides", HINT_MODEL)
        return (directory, [str(o) for o in overrides]), ""
    return None, ""


def run_config(checkpoint: Path, model: Optional[str], overrides: List[str]) -> Any:
    """The config the run trained with, composed again: its recorded overrides, then ``model`` (replacing
    the recorded model file) and ``overrides`` (each replacing the recorded value of its key)."""
    for o in overrides:
        if "=" not in o:
            raise ElasticFlowError(f"unexpected argument {o!r}", "config overrides take the form key=value, "
                                                                 "e.g. model_args.hidden=128")
    refuse_renamed(overrides)
    run, why = _run_of(checkpoint)
    recorded = None if run is None else run[1]
    if recorded is None and model is None:
        raise ElasticFlowError(f"cannot tell which model file wrote '{checkpoint}': no {RUN_OVERRIDES} in its "
                               f"run directory (trained with ElasticTrainer, or checkpoint.dir outside the run){why}",
                               HINT_MODEL)
    mine = {_key(o) for o in overrides} | ({"model"} if model else set())
    base = [o for o in recorded or [] if not o.startswith("hydra.") and _key(o) not in mine]
    if model is not None:
        file = Path(model).expanduser()
        if not file.is_file():
            raise ElasticFlowError(f"model file '{model}' {'is a directory' if file.is_dir() else 'not found'}",
                                   "pass --model the Python file that trained the checkpoint")
        base.insert(0, f"model={file.resolve()}")
    cfg = composed([*base, *overrides])
    if not Path(str(cfg.model)).is_file():
        raise ElasticFlowError(f"the model file that trained '{checkpoint}', {cfg.model}, is not found",
                               "pass its new path with --model MODEL.py")
    validate(cfg)
    if not cfg.launcher.trust_shared_dirs:  # as `elasticflow train` checks them, before the model file is imported
        from ._util.paths import refuse_code_folder, refuse_if_shared

        if run is not None:
            refuse_if_shared(run[0], "run directory")
        refuse_code_folder(Path(str(cfg.model)).parent, "model file's folder")
    return cfg


# ---------------------------------------------------------------- rebuild, load, write
def _export_into(checkpoint: Path, cfg: Any, out: Path, meta: Dict[str, str]) -> str:
    """Rebuild the model, load ``checkpoint`` into it, write it into ``out``; returns the form written."""
    with ops.using(cfg.backend.name) as backend:  # the caller's backend (in-process use) comes back after
        backend.setup(None, int(cfg.seed))  # model() builds as in training (keras's dtype policy, seeds)
        mf = model_file.load(cfg.model)
        built = model_file.build(mf, cfg, backend)
        # Engine names what the checkpoint holds (frozen parameters, stateful buffers, "net." of a dict of
        # modules); its load_state writes into the model's own tensors. Built on the CPU in float32.
        engine = backend.Engine(built.model, mf.forward, built.optimizer, jit=False)
        expected = {n: tuple(a.shape) for n, a in engine.state(copy=False).items()
                    if not n.startswith(("optimizer/", "rng/"))}
        tensors = read_metadata(checkpoint)["tensors"]
        found = {n: tuple(t["shape"]) for n, t in tensors.items() if not n.startswith(("optimizer/", "rng/"))}
        diffs = list(compare_names(expected, found))
        if diffs:
            shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
            raise ElasticFlowError(f"checkpoint '{checkpoint}' does not fit the model {Path(cfg.model).name} "
                                   f"builds: {shown}", HINT_MODEL)
        arrays = load(checkpoint, names=sorted(expected))  # the weights only: optimizer slots are not read
        engine.load_state(arrays, 0)
        return _write(_unwrapped(built.model, backend), arrays, out, meta)


def _unwrapped(model: Any, backend: Any) -> Any:
    """``{"net": module}`` (model() returned it beside its optimizer) -> the module, with its own keys;
    ``torch.compile(net)`` -> ``net`` (the wrapper's keys gain ``_orig_mod.``, which ``Net()`` does not load)."""
    model = backend.unwrapped(model)
    if isinstance(model, dict) and len(model) == 1 and backend.is_native(next(iter(model.values()))):
        return next(iter(model.values()))
    return model


def _module(name: str, cls: str) -> Any:
    """``sys.modules[name].<cls>`` when that framework is imported already, else None (never imports it)."""
    module = sys.modules.get(name)
    return getattr(module, cls, None) if module is not None else None


def _write(model: Any, arrays: Dict[str, Any], out: Path, meta: Dict[str, str]) -> str:
    pretrained, module = _module("transformers", "PreTrainedModel"), _module("torch.nn", "Module")
    keras_layer, tf_module = _module("keras", "Layer"), _module("tensorflow", "Module")
    if isinstance(model, dict) and module is not None and model and all(isinstance(v, module) for v in model.values()):
        import torch

        model = torch.nn.ModuleDict(model)  # several modules: their keys "<name>.<key>", as ModuleDict loads them
    adapter = _module("peft", "PeftModel")
    if adapter is not None and isinstance(model, adapter):
        _write_adapter(model, out, meta)
        return "peft adapter (save_pretrained), and the merged model in merged/"
    if pretrained is not None and isinstance(model, pretrained):
        _write_pretrained(model, out, meta)
        return f"transformers {type(model).__name__} (save_pretrained)"
    if keras_layer is not None and isinstance(model, keras_layer):
        # Before torch's: a keras model on KERAS_BACKEND=torch is a torch.nn.Module too, and its users load
        # keras weights (load_weights), not a state_dict.
        model.save_weights(str(out / KERAS_WEIGHTS))
        return "keras weights (save_weights)"
    if module is not None and isinstance(model, module):
        _write_state_dict(model, out, meta)
        return "torch state_dict"
    if tf_module is not None and isinstance(model, tf_module):
        import tensorflow as tf

        tf.train.Checkpoint(model=model).write(str(out / "model"))
        return "tf.train.Checkpoint"
    if isinstance(model, dict):
        from safetensors.numpy import save_file

        save_file({n: a for n, a in arrays.items()}, str(out / WEIGHTS), metadata=meta)
        return "arrays by name"
    raise ElasticFlowError(f"export cannot write a {type(model).__name__}",
                           "elasticflow.checkpoint.load(CHECKPOINT) returns its tensors by name")


def _write_state_dict(module: Any, out: Path, meta: Dict[str, str]) -> None:
    from safetensors.torch import save_file

    # Copies: the Engine made every parameter a view of its one flat buffer, and a tied alias is the same
    # tensor under two keys; safetensors refuses tensors that share memory. "format": "pt" is what
    # transformers' from_pretrained asks of a safetensors file.
    state = {k: v.detach().cpu().clone().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt", **meta})


def _write_adapter(model: Any, out: Path, meta: Dict[str, str]) -> None:
    """A peft model: its adapter as peft saves it (adapter_config.json, adapter_model.safetensors:
    ``PeftModel.from_pretrained(base, out)``), and in ``merged/`` the base model with the adapter merged into
    its weights, as its own framework saves it (``from_pretrained``, or a state_dict for a plain module).
    Not one folder: transformers' from_pretrained reads a folder holding adapter_config.json as an adapter."""
    with _quiet_progress():
        model.save_pretrained(str(out))
    merged = model.merge_and_unload()  # the exported copy only: this model was built for the export
    pretrained = _module("transformers", "PreTrainedModel")
    (out / "merged").mkdir()
    if pretrained is not None and isinstance(merged, pretrained):
        _write_pretrained(merged, out / "merged", meta)
    else:
        _write_state_dict(merged, out / "merged", meta)


@contextlib.contextmanager
def _quiet_progress():
    """transformers' "Writing model shards" bar off for a save: noise beside export's one line."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _write_pretrained(model: Any, out: Path, meta: Dict[str, str]) -> None:
    import torch

    with torch.no_grad():  # each parameter its own storage again (a tied one stays one Parameter: still tied)
        for p in model.parameters():
            p.data = p.data.clone()
    with _quiet_progress():
        model.save_pretrained(str(out))
    if (out / WEIGHTS).is_file():
        # save_pretrained leaves tied aliases out (from_pretrained ties them again); rewritten with every
        # state_dict key, the same file also loads with load_state_dict(strict=True), as a torch model's does.
        _write_state_dict(model, out, meta)

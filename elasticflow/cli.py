"""`elasticflow train|scale|inject|status|plot|sync|inspect|export`: parse, hand over, nothing else."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

from ._util.envnames import ENV_DEBUG
from .errors import ElasticFlowError
from .launchers.exits import debug_requested, fail, print_done, report

USAGE = """usage: elasticflow train MODEL.py [hydra overrides...] [--cfg job] [-m] [--debug]
       elasticflow scale RUN_DIR --workers N
       elasticflow inject RUN_DIR --kill R | --hang R | --slow R --factor F [--for S] | --bitflip R [--bit B]
       elasticflow status RUN_DIR [--json]
       elasticflow plot RUN_DIR [-o FILE.png]
       elasticflow sync RUN_DIR
       elasticflow inspect CHECKPOINT_DIR
       elasticflow checkpoint commit RUN_DIR
       elasticflow export CHECKPOINT --to DIR [--best] [--model MODEL.py] [key=value ...]
       elasticflow --version

Train the model file's model(), forward() and data(); any config key can be overridden, e.g.
  elasticflow train models/digits_mlp.py optimizer=adam trainer.global_batch_size=128
`elasticflow train --help` lists every config key and group."""


# Hydra's flags that take a value (`--cfg job`, `-p trainer`); --info's value is optional and not listed.
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
                          "--config-dir", "-cd", "--experimental-rerun"}

INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}  # Hydra's --info [WHAT]

# With these, Hydra's own messages stay: a sweep's comma lists are not one config, and another config
# name or directory is not the conf/ that config.composed() reads.
HYDRA_OWN_MESSAGES = {"-m", "--multirun", "--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd",
                      "--experimental-rerun"}


def _train_task(cfg) -> float:
    """One run (one job of a sweep); returns its objective, the value a sweeper such as Optuna optimizes."""
    from hydra.core.hydra_config import HydraConfig

    from .config.schema import validate
    from .launchers import run

    try:
        # The one validation for `elasticflow train` (every job of a -m sweep gets its own).
        validate(cfg)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        summary = run(cfg, run_dir)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes one reported line
        if isinstance(exc, SystemExit):
            raise
        report(exc, debug_requested())
    print_done(summary, run_dir)
    name = cfg.objective or ("eval_loss" if "eval_loss" in summary else "loss")
    if not isinstance(summary.get(name), (int, float)):
        if not cfg.objective:  # a run with nothing left to train has no loss: not an error unless one was asked for
            return float("nan")
        fail(f"objective={name} is not in the run's result (it has: {', '.join(summary)})",
             "pass objective=eval_loss (or another number of the `done:` line); the run itself finished")
    return float(summary[name])


def train(args: List[str], debug: bool) -> None:
    import hydra

    from .config.schema import composed, refuse_renamed, register
    from ._util.paths import conf_dir

    # Hydra's own argparse wants its flags before the overrides: split them apart.
    positional, flags, overrides, skip_value = [], [], [], False
    for a in args:
        if skip_value:  # the value of a Hydra flag such as `--cfg job`
            flags.append(a)
            skip_value = False
        elif a in HYDRA_FLAGS_WITH_VALUE:
            flags.append(a)
            skip_value = True
        elif a.startswith("-"):
            flags.append(a)
        elif flags and flags[-1] in ("--info", "-i") and a in INFO_CHOICES:
            flags.append(a)
        elif "=" not in a:
            positional.append(a)
        else:
            overrides.append(a)
    refuse_renamed(overrides)  # before Hydra, whose "Key 'async' not in" would not name the new key
    wants_help = any(a in ("--help", "-h", "--hydra-help") for a in args)
    if positional:
        model = positional[0]
        if len(positional) > 1:
            fail(f"unexpected argument {positional[1]!r} after the model file",
                 "config overrides take the form key=value, e.g. trainer.max_steps=100")
        path = Path(model).expanduser()
        if not path.is_file():
            fail(f"model file '{model}' {'is a directory' if path.is_dir() else 'not found'}",
                 "pass the path to a Python file that defines model(), forward() and data()")
        overrides.insert(0, f"model={path.resolve()}")
    elif not wants_help:
        fail("no model file given", "usage: elasticflow train MODEL.py [key=value ...], e.g. models/digits_mlp.py")
    if debug:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    if not wants_help and not HYDRA_OWN_MESSAGES & set(flags):
        # Composed once before Hydra's run (~60 ms) so that a bad override is one line with a hint (with
        # --debug, after the traceback of Hydra's error).
        composed(overrides)
    elif not wants_help and {"-m", "--multirun"} & set(flags) and not (HYDRA_OWN_MESSAGES - {"-m", "--multirun"}) \
            & set(flags):
        _check_sweep(overrides)
    register()
    for i, flag in enumerate(list(flags)):  # --info's value is optional: without one it would take an override
        if flag in ("--info", "-i") and (i + 1 == len(flags) or flags[i + 1] not in INFO_CHOICES):
            flags.insert(i + 1, "all")
    sys.argv = ["elasticflow train", *flags, *overrides]
    run_hydra = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_train_task)
    if wants_help and "--hydra-help" not in args:
        _help_with_meanings(run_hydra)
    else:
        run_hydra()


def _check_sweep(overrides: List[str]) -> None:
    """Every job of a ``-m`` sweep composed and validated exactly as a single run would be, before any starts: a
    sweep of ``+optimizer.lrr=0.5,0.01`` once trained every job at the default lr. Hydra's basic sweeper's
    expansion (comma lists, range(), choice()); another sweeper (``hydra/sweeper=optuna``) draws its own jobs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .config.schema import composed, validate

    if any(o.startswith(("hydra/sweeper=", "hydra.sweeper")) for o in overrides):
        return
    try:
        jobs = [job for batch in BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
                for job in batch]
    except Exception:  # noqa: BLE001 - a sweep Hydra cannot parse: Hydra says why, in its own words
        return
    for n, job in enumerate(jobs):
        try:
            validate(composed(job))
        except ElasticFlowError as exc:
            fail(f"job {n} of the sweep ({' '.join(job[1:] if job[0].startswith('model=') else job)}): "
                 f"{exc.message}", exc.hint)


def _help_with_meanings(run_hydra) -> None:
    """Hydra's --help (conf/config.yaml's template), each config key with its meaning from the schema's
    comments (config/help.py). Captured, then printed: Hydra prints the help in one piece and exits."""
    import contextlib
    import io

    from .config.help import annotate

    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            run_hydra()
    finally:
        print(annotate(captured.getvalue(), after="== Config ("), end="", flush=True)


def inspect_checkpoint(args: List[str]) -> None:
    from .checkpoint.inspect import render

    if len(args) != 1:
        fail("inspect takes one checkpoint directory", "e.g. elasticflow inspect outputs/.../checkpoints/step_100, "
             "or a run directory for its newest checkpoint")
    print(render(Path(args[0])))


def checkpoint_command(args: List[str]) -> None:
    """`checkpoint commit RUN_DIR`: commit the run's last save from its shard files (checkpoint/finish.py)."""
    from .checkpoint.finish import commit_run

    if len(args) != 2 or args[0] != "commit" or args[1].startswith("-"):
        fail(f"checkpoint takes `commit RUN_DIR`, got {' '.join(args) or 'nothing'}",
             "e.g. elasticflow checkpoint commit outputs/2026-11-22/10-00-00: commits the run's last save once "
             "every worker's shard of it is on disk")
    print(commit_run(Path(args[1])))


def export_command(args: List[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="elasticflow export",
                                     description="write a checkpoint's weights in the model's own framework form")
    parser.add_argument("checkpoint", type=Path,
                        help="a checkpoint, or a job, checkpoint or run directory (its newest)")
    parser.add_argument("--to", type=Path, required=True, metavar="DIR", help="a new or empty directory")
    parser.add_argument("--model", metavar="MODEL.py",
                        help="the model file (default: the run's, from RUN_DIR/.hydra/overrides.yaml)")
    parser.add_argument("--best", action="store_true",
                        help="the best checkpoint by checkpoint.monitor, not the newest")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides on top of the run's")
    ns = parser.parse_intermixed_args(args)
    from .exporting import export

    print(export(ns.checkpoint, ns.to, ns.model, ns.overrides, best=ns.best).describe())


def scale_command(args: List[str]) -> None:
    import argparse

    from .distributed.agent.control import scale
    from .launchers.kubernetes import is_kubernetes_run, scale as scale_kubernetes

    parser = argparse.ArgumentParser(prog="elasticflow scale", description="grow or shrink a running job")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the new membership")
    ns = parser.parse_args(args)
    if ns.workers < 1:
        fail(f"--workers must be a positive integer, got {ns.workers}", "e.g. elasticflow scale RUN_DIR --workers 4")
    if is_kubernetes_run(ns.run_dir):  # its agent is in the cluster: patch the elastic Job instead
        print(scale_kubernetes(ns.run_dir, ns.workers))
        return
    print(scale(ns.run_dir, ns.workers, ns.wait))


def inject_command(args: List[str]) -> None:
    import argparse

    from .distributed.agent.control import inject

    parser = argparse.ArgumentParser(prog="elasticflow inject", description="cause a fault in a running job, to "
                                     "rehearse its recovery (docs/elastic-training.md)")
    parser.add_argument("run_dir", type=Path)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--kill", type=int, metavar="RANK", help="SIGKILL that rank's worker")
    what.add_argument("--hang", type=int, metavar="RANK", help="SIGSTOP it: cut out as hung after the heartbeat "
                      "timeout")
    what.add_argument("--slow", type=int, metavar="RANK", help="make it F times slower (--factor; 1 ends it)")
    what.add_argument("--bitflip", type=int, metavar="RANK", help="flip one bit of a parameter in that rank's "
                      "replica (--bit, --tensor): the members' fingerprints catch it (elastic.fingerprint)")
    parser.add_argument("--bit", type=int, help="with --bitflip: which bit of the float32, 0-31 (default 22)")
    parser.add_argument("--tensor", default="", help="with --bitflip: a parameter's name (default: the first), or "
                        "an optimizer slot as optimizer/<parameter>/<slot>")
    parser.add_argument("--factor", type=float, help="with --slow: how many times slower (> 1; 1 ends a slowdown)")
    parser.add_argument("--for", dest="for_s", type=float, default=0.0, help="with --slow: for S seconds (default: "
                        "until the run ends)")
    ns = parser.parse_args(args)
    action = next(a for a in ("kill", "hang", "slow", "bitflip") if getattr(ns, a) is not None)
    rank = getattr(ns, action)
    if rank < 0:
        fail(f"a rank is 0 or more, got {rank}", f"see the ranks in `elasticflow status {ns.run_dir}`")
    if action == "slow" and (ns.factor is None or not ns.factor >= 1.0):
        fail(f"--slow needs --factor F with F >= 1, got {ns.factor}", "e.g. elasticflow inject RUN --slow 1 --factor 3")
    if action != "slow" and (ns.factor is not None or ns.for_s):
        fail(f"--factor and --for go with --slow, not --{action}", f"e.g. elasticflow inject RUN --{action} {rank}")
    if ns.for_s < 0:
        fail(f"--for is seconds, 0 or more, got {ns.for_s:g}", "leave it out to slow the worker until the run ends")
    if action != "bitflip" and (ns.bit is not None or ns.tensor):
        fail(f"--bit and --tensor go with --bitflip, not --{action}", f"e.g. elasticflow inject RUN --{action} {rank}")
    bit = 22 if ns.bit is None else ns.bit
    if action == "bitflip" and not 0 <= bit <= 31:
        fail(f"--bit must be 0..31 (a float32's bits), got {bit}", "e.g. --bit 22, the mantissa's highest")
    print(inject(ns.run_dir, action, rank, float(bit) if action == "bitflip" else ns.factor or 1.0, ns.for_s,
                 ns.tensor))


def status_command(args: List[str]) -> None:
    import json

    from .observability.status import status, status_record

    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if len(args) != 1 or args[0].startswith("-"):
        fail(f"status takes one run directory and optionally --json, got {' '.join(args) or 'nothing'}",
             "e.g. elasticflow status outputs/2026-11-22/10-00-00 --json")
    run_dir = Path(args[0])
    print(json.dumps(status_record(run_dir), indent=1) if as_json else status(run_dir))


def plot_command(args: List[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="elasticflow plot", description="loss, throughput and workers of a run")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("-o", "--output", type=Path, help="the image to write (default RUN_DIR/run.png)")
    ns = parser.parse_args(args)
    try:
        import matplotlib  # noqa: F401 - an optional dependency: say so before anything else
    except ImportError:
        fail("elasticflow plot needs matplotlib, which is not installed", "pip install 'elasticflow[plot]'")
    from .observability.plot import plot

    print(f"wrote {plot(ns.run_dir, ns.output)}")


def sync_command(args: List[str]) -> None:
    """Hand the run's trackers (trainer.loggers) the records they missed when its end cut them off."""
    from .observability.sidecar import sync

    if len(args) != 1 or args[0].startswith("-"):
        fail(f"sync takes one run directory, got {' '.join(args) or 'nothing'}",
             "e.g. elasticflow sync outputs/2026-11-22/10-00-00 (the one its warning named)")
    sync(Path(args[0]))


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if debug:
        os.environ[ENV_DEBUG] = "1"
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] == "--version":
        from importlib.metadata import version  # not `from . import __version__`: the package imports fit() from here

        print(f"elasticflow {version('elasticflow')}")
        return
    command, rest = argv[0], argv[1:]
    commands = {"train": lambda: train(rest, debug), "inspect": lambda: inspect_checkpoint(rest),
                "scale": lambda: scale_command(rest), "inject": lambda: inject_command(rest),
                "status": lambda: status_command(rest),
                "plot": lambda: plot_command(rest), "export": lambda: export_command(rest),
                "checkpoint": lambda: checkpoint_command(rest),
                "sync": lambda: sync_command(rest)}
    if command not in commands:
        fail(f"unknown command {command!r}", f"use one of: {', '.join(commands)} (elasticflow --help)")
    try:
        commands[command]()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001
        report(exc, debug)


def entry() -> None:
    """The ``elasticflow`` command (and ``python -m elasticflow.cli``): ``main()``, then exit without the
    interpreter's teardown. With torch imported that teardown (freeing every module's objects) took ~0.6 s of
    a 2.6 s 1-worker run, on every command of every job; the work that must happen at exit does: non-daemon
    threads are joined and atexit handlers run (checkpoint folder leases, trackers), as Python's own exit does
    first, and the streams are flushed. ``main()`` itself returns, for callers in a process of their own
    (``elasticflow.fit()``, the tests)."""
    import atexit
    import logging
    import threading

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    getattr(threading, "_shutdown", lambda: None)()  # what the interpreter does first: join non-daemon threads
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`elasticflow ... | head`)
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()

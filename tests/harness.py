"""The one test harness: start a job, wait for what it does, read what it wrote, and compare it with the
1-worker run. Test files import from here (and fixtures come from conftest.py); a test file never imports
another test file.

    proc = start(run, "launcher.workers=3", env={"EF_PROBE_KILL": "1:20:forward"})   # PROBE, COMMON
    wait_for(lambda: logged_step(run) >= 10, 120, "step 10")
    out = finish(proc)                                    # its output; an error (with it) after the timeout
    assert_equivalent(run, reference)                     # `reference`: conftest's cached 1-worker run

Every wait is for an event or a file, with a deadline, and every process started here is reaped: the clock
bounds a wait, it never decides a test (timings belong in scripts/bench/bench_*.py).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Union

import numpy as np

import elasticflow.checkpoint as ckpt

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
ELASTICFLOW = [sys.executable, "-m", "elasticflow.cli"]

# The elastic tests' job: the digits MLP with fault injection (tests/models/digits_probe.py documents its
# EF_PROBE_* knobs), 60 plain-SGD steps of 64 samples, every step logged.
PROBE = Path(__file__).parent / "models" / "digits_probe.py"
STEPS = 60
SAMPLES = 1437  # the digits training split: one epoch
COMMON = ["trainer.global_batch_size=64", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
          "trainer.progress=false", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5", "elastic.wait_s=30",
          "optimizer.lr=0.1"]
# The suite's bound on "the same model as one worker" (assert_equivalent): another number of workers sums a
# step's gradient in another order, which moves float32 results in the last bits; plain SGD over 60 steps
# stays within ~4e-7 (docs/exactness.md), so 1e-5 leaves a margin and still catches a lost or doubled sample.
RTOL = 1e-5

Run = Union[str, Path]


# ---------------------------------------------------------------- the CLI
def run_cli(args: List, cwd: Optional[Path] = None, timeout: float = 300, env: Optional[dict] = None,
            check: bool = False) -> subprocess.CompletedProcess:
    """`elasticflow ARGS` in a subprocess, bounded in time; returns the completed process (text output)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(ELASTICFLOW + [str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"elasticflow {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def cli(args: List, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`elasticflow ARGS` in this process (elasticflow.cli.main): its exit code, stdout and stderr, as run_cli
    returns them, without a new interpreter. For the error paths that end before a training step (a bad
    setting or model file, a refused request); a job that trains runs in a subprocess (run_cli, start), and so
    does one case of each exit code, --debug, and a closed pipe.

    What the CLI changes in the process is put back after it: os.environ, sys.argv, the working directory,
    the root logger's handlers and level (Hydra's job logging), which loggers are disabled, and Hydra's global
    state. Hydra's logging configuration would also shut down every logging handler of this process
    (logging.config's dictConfig does, before it configures): pytest's, TensorFlow's (absl, whose handler then
    closes the stream it holds): that step is skipped here."""
    import contextlib
    import io
    import logging
    import logging.config

    from hydra.core.global_hydra import GlobalHydra

    from elasticflow import cli as entry

    out, err, code = io.StringIO(), io.StringIO(), 0
    environ, argv, cwd = dict(os.environ), sys.argv[:], os.getcwd()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    disabled = {name: lg.disabled for name, lg in logging.root.manager.loggerDict.items()
                if isinstance(lg, logging.Logger)}
    clear_handlers = logging.config._clearExistingHandlers
    logging.config._clearExistingHandlers = lambda: None
    try:
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                entry.main([str(a) for a in args])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.argv[:] = argv
        os.chdir(cwd)
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        for name, was in disabled.items():
            logging.getLogger(name).disabled = was
        logging.config._clearExistingHandlers = clear_handlers
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess(["elasticflow", *map(str, args)], code, out.getvalue(), err.getvalue())


def train(model: Run, run_dir: Path, *overrides: str, timeout: float = 300, check: bool = True,
          env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`elasticflow train MODEL hydra.run.dir=RUN_DIR OVERRIDES...` to its end (MODEL: a path, or a name
    under models/)."""
    model = Path(model)
    if not model.is_absolute() and not model.exists():
        model = MODELS / model
    return run_cli(["train", model, f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides],
                   timeout=timeout, check=check, env=env)


def train_in_process(model: Run, run_dir: Path, *overrides: str, env: Optional[dict] = None
                     ) -> subprocess.CompletedProcess:
    """train()'s command line through cli(): for a run that fails before its first step."""
    model = Path(model)
    if not model.is_absolute() and not model.exists():
        model = MODELS / model
    return cli(["train", model, f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides], env=env)


def fit_here(model: Run, run_dir: Path, *overrides: str) -> None:
    """One worker's training in this process: ``ElasticTrainer.fit``, the trainer a CLI job's worker runs, with
    conf/'s defaults and OVERRIDES. For a test that imports the model's framework anyway (transformers, Keras):
    a CLI job would import it again. Torch's thread count, its deterministic kernels (trainer.reproducible turns
    them on) and the backend active before are put back after."""
    import torch

    from elasticflow import ops
    from elasticflow.config.schema import compose
    from elasticflow.trainer import ElasticTrainer

    model = Path(model)
    if not model.is_absolute() and not model.exists():
        model = MODELS / model
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        with ops.using():
            ElasticTrainer(str(model), compose(str(model), list(overrides)), run_dir=str(run_dir)).fit()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def start(run_dir: Path, *overrides: str, env: Optional[dict] = None, model: Run = PROBE,
          common: List[str] = COMMON, new_session: bool = False, stdout=subprocess.PIPE) -> subprocess.Popen:
    """`elasticflow train MODEL hydra.run.dir=RUN_DIR COMMON OVERRIDES` in the background (the CLI process
    is the agent); stdout and stderr together, as text. ``new_session``: its own process group, as a
    terminal's job is (a signal to the group reaches the agent only; workers have sessions of their own)."""
    cmd = ELASTICFLOW + ["train", str(model), f"hydra.run.dir={run_dir}", *common, *overrides]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=stdout,
                            stderr=subprocess.STDOUT, text=True, start_new_session=new_session)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    """Wait for PROC to end; its output. Past the timeout it is killed (its process group too, where it
    leads one, as tests/hosts.py's commands do) and the test fails with the end of its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = reap(proc)
        raise AssertionError(f"run did not finish in {timeout}s:\n{out[-4000:]}") from None
    return out or ""


def stop(proc: subprocess.Popen, sig: int, timeout: float = 60) -> str:
    """Send SIG to PROC and reap it (SIGKILL past the timeout); its output."""
    try:
        proc.send_signal(sig)
        return proc.communicate(timeout=timeout)[0] or ""
    except subprocess.TimeoutExpired:
        return reap(proc)
    finally:
        if proc.poll() is None:
            reap(proc)


def reap(proc: subprocess.Popen) -> str:
    """SIGKILL PROC (its process group too, where it leads one) and collect it; what it printed."""
    if proc.poll() is not None:
        try:
            return proc.communicate(timeout=10)[0] or ""
        except subprocess.TimeoutExpired:
            return ""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass
    try:
        return proc.communicate(timeout=10)[0] or ""
    except subprocess.TimeoutExpired:  # its workers (sessions of their own) still hold the pipe
        return ""


def train_ok(run_dir: Path, *overrides: str, env: Optional[dict] = None, model: Run = PROBE,
             common: List[str] = COMMON, timeout: float = 240) -> str:
    """start() to the end; asserts exit 0; the job's output."""
    proc = start(run_dir, *overrides, env=env, model=model, common=common)
    out = finish(proc, timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def scale(run_dir: Path, workers: int, wait: float = 120) -> subprocess.CompletedProcess:
    """`elasticflow scale RUN_DIR --workers N --wait S` (exit 0 asserted)."""
    return run_cli(["scale", run_dir, "--workers", workers, "--wait", wait], timeout=wait + 60, check=True)


class Hold:
    """A file whose existence keeps every worker of tests/models/digits_probe.py waiting inside forward()
    (EF_PROBE_HOLD), so that a scale or a kill lands at a known point. A hold longer than
    elastic.timeout_s looks exactly like a hung worker (its peer waits in a collective): such tests raise it."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.touch()
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)


class Limit:
    """How far training may go (tests/models/digits_probe.py's EF_PROBE_LIMIT): the job waits at that step, so a
    fixed-length job cannot end before the test has acted, however loaded the machine."""

    def __init__(self, path: Path, step: int, last: int = STEPS - 5):
        self.path, self.step, self.last = path, step, last
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")  # written whole: the workers read it at every step
        tmp.write_text(str(self.step))
        os.replace(tmp, self.path)

    def allow(self, step: int) -> None:
        """Let training run up to STEP (and wait there)."""
        self.step = step
        self._write()

    def advance_until(self, run: Path, predicate, timeout: float, what: str):
        """Let training go a step at a time (a membership change happens at a step boundary) until PREDICATE."""
        def done():
            if predicate():
                return True
            if logged_step(run) >= self.step - 1:  # at the limit: step N's record comes as step N + 1 reduces
                assert self.step < self.last, f"the job's steps nearly spent, still waiting for {what}"
                self.step += 1
                self._write()
            return False
        wait_for(done, timeout, what, every=0.25)

    def lift(self) -> None:
        self.path.unlink()

    def held(self) -> set:
        return held(self.path)


def lose_join_retire(run: Path, proc: subprocess.Popen, limit: "Limit") -> str:
    """Drive a 3-worker job through its membership changes: once a step ran with the two survivors of a kill the
    job's environment caused, a worker joins (`elasticflow scale` to 3) and, after a step with it, one retires
    (to 2); then the limit is lifted and the job finishes. Asserts exit 0 and one left, one joined and one retired
    event; returns the job's output."""
    limit.advance_until(run, lambda: 2 in world_sizes(run), 120, "a step with the two survivors")
    scale(run, 3, wait=0)  # a new worker joins: training waits at the limit while it starts
    wait_for(lambda: len(workers(run)) == 3, 180, "the joiner admitted", proc=proc)
    limit.advance_until(run, lambda: world_sizes(run)[-1] == 3, 120, "a step with the joiner")
    scale(run, 2, wait=0)  # and one retires
    limit.advance_until(run, lambda: world_sizes(run)[-1] == 2 and len(members(run)) == 2, 120,
                        "a step after the scale-down")
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    kinds = [e["event"] for e in events(run)]
    assert kinds.count("left") == 1 and kinds.count("joined") == 1 and kinds.count("retired") == 1, kinds
    return out


def held(path: Path) -> set:
    """The pids of the workers waiting at a Hold's or a Limit's PATH now (each marks itself while it waits)."""
    return {int(p.name.rsplit("-", 1)[1]) for p in path.parent.glob(f"{path.name}.held-*")}


# ---------------------------------------------------------------- waiting
def wait_for(predicate: Callable, timeout: float, what: str, every: float = 0.02,
             proc: Optional[subprocess.Popen] = None):
    """Poll PREDICATE until it returns something truthy, and return that. Fails after TIMEOUT s, or at once
    if PROC (the job being watched) has exited. EVERY: the poll interval (a poll may be a SLURM command)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{(out or '')[-3000:]}")
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# ---------------------------------------------------------------- what a run wrote
def _jsonl(path: Path) -> List[dict]:
    """The records of a JSON-lines file (a torn last line, being written, is left out)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def metrics(run_dir: Path) -> List[dict]:
    """Every record of RUN_DIR/metrics.jsonl (training and eval records)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> List[float]:
    """The per-step training losses (needs trainer.log_every=1), in step order."""
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


def world_sizes(run_dir: Path) -> List[int]:
    """Each logged step's world size; [] before the first step."""
    path = Path(run_dir) / "metrics.jsonl"
    return [r["world_size"] for r in _jsonl(path) if "loss" in r] if path.is_file() else []


def logged_step(run_dir: Path) -> int:
    """The newest logged step; 0 before the first."""
    path = Path(run_dir) / "metrics.jsonl"
    return max([r["step"] for r in _jsonl(path) if "loss" in r] or [0]) if path.is_file() else 0


def events(run_dir: Path, kind: Optional[str] = None) -> List[dict]:
    """RUN_DIR/events.jsonl's records (those of event KIND); [] before the file exists."""
    path = Path(run_dir) / "events.jsonl"
    found = _jsonl(path) if path.is_file() else []
    return [e for e in found if kind is None or e["event"] == kind]


def members(run_dir: Path) -> list:
    """The current generation's members, from workers.json."""
    return json.loads((Path(run_dir) / "workers.json").read_text())["members"]


def workers(run_dir: Path) -> list:
    """Members and admitted joiners, from workers.json; [] while it cannot be read."""
    try:
        snapshot = json.loads((Path(run_dir) / "workers.json").read_text())
    except (FileNotFoundError, ValueError):
        return []
    return snapshot["members"] + [w for w in snapshot["joining"] if w["state"] == "admitted"]


def final_state(run_dir: Path, rng: bool = True) -> Dict[str, np.ndarray]:
    """The run's newest checkpoint, every tensor (without the rng/ streams where ``rng`` is false)."""
    newest = ckpt.latest(Path(run_dir) / "checkpoints")
    assert newest is not None, f"no checkpoint under {run_dir}"
    return {n: v for n, v in ckpt.load(newest).items() if rng or not n.startswith("rng/")}


def saved(run_dir: Path) -> Dict[str, Path]:
    """{name: path} of the complete checkpoints under RUN_DIR/checkpoints, whatever the layout below it (a save
    still in its temporary directory, .step_N.tmp-*, is not one yet). A walk that meets a temporary directory
    just renamed by its commit (or pruned) walks again: a live run changes the tree under it."""
    for _ in range(50):
        try:
            found = [p for p in (Path(run_dir) / "checkpoints").rglob("*")
                     if p.is_dir() and not p.name.startswith(".") and ckpt.is_complete(p)]
            break
        except FileNotFoundError:
            continue
    else:
        raise AssertionError(f"the checkpoints under {run_dir} kept changing under 50 walks")
    names = [p.name for p in found]
    assert len(names) == len(set(names)), names
    return {p.name: p for p in found}


def job_log(run_dir: Path) -> str:
    """A launcher=slurm run's job output (every requeue's, in order)."""
    return "\n".join(p.read_text() for p in sorted((Path(run_dir) / "slurm").glob("job-*.out")))


def job_done(cluster, job: int, run_dir: Path, timeout: float = 120) -> dict:
    """A SLURM job's scontrol record once it has ended (tests/slurm_cluster.py's CLUSTER); past the timeout, an
    error with the end of the job's log."""
    try:
        return cluster.wait_done(job, timeout=timeout)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n--- the job's log (end)\n{job_log(run_dir)[-3000:]}") from None


def flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # inside the tensor data: the file still parses, only the checksum can tell
    path.write_bytes(bytes(raw))


def consumed_by_epoch(run_dir: Path, record: Path) -> Dict[int, Counter]:
    """The sample ids tests/models/digits_probe.py recorded under EF_PROBE_RECORD, per epoch, counting each
    step's ids from the generation that committed it (metrics.jsonl): a step redone after a failure counts once.
    Under topology=local_sgd|diloco a replica's part of a step counts from the generation that trained the
    replica whose move the round used (the ``round`` events' ``trained_in``): a survivor keeps its own."""
    committed = {r["step"]: r["generation"] for r in metrics(run_dir) if "loss" in r}
    trained: Dict[tuple, int] = {}  # (step, replica) -> generation
    for e in events(run_dir, "round"):
        for step in range(e["first_step"], e["last_step"] + 1):
            trained.update(((step, k), g) for k, g in enumerate(e["trained_in"]))
    consumed: Dict[int, Counter] = {}
    for f in Path(record).glob("*.jsonl"):  # named by pid: two hosts' workers may share one, lines say whose
        for line in f.read_text().splitlines():
            r = json.loads(line)
            replica = r.get("replica", -1)
            used = trained.get((r["step"], replica)) if replica >= 0 else committed.get(r["step"])
            if used == r["generation"]:
                consumed.setdefault(r["epoch"], Counter()).update(r["ids"])
    return consumed


def assert_each_sample_once(run_dir: Path, record: Path, samples: int = SAMPLES) -> None:
    """Per epoch, the ids that went into committed steps: every sample exactly once in each complete epoch,
    none twice in the last (partial) one, and as many in all as the run says it has seen."""
    consumed = consumed_by_epoch(run_dir, record)
    assert consumed, f"nothing recorded under {record}"
    last = max(consumed)
    for epoch, seen in consumed.items():
        if epoch < last:
            assert seen == Counter(range(samples)), f"epoch {epoch}"
        else:
            assert max(seen.values()) == 1, f"epoch {epoch}: a sample used twice"
    steps = [r for r in metrics(run_dir) if "loss" in r]
    assert sum(sum(c.values()) for c in consumed.values()) == steps[-1]["samples_seen"]


# ---------------------------------------------------------------- the comparison with the 1-worker run
def assert_equivalent(run: Union[Run, Mapping], reference: Union[Run, Mapping], *, rtol: float = RTOL,
                      floor: float = 0.0, rng: bool = False, records: bool = True, redone: bool = False) -> None:
    """Assert that RUN ended on REFERENCE's model: the one rule by which the suite says "the same model as
    the 1-worker run".

    The rule, per tensor of the reference's final checkpoint: the relative difference
    ``||got - want||_2 / ||want||_2`` (in float64) is at most ``rtol``; with ``floor`` > 0 a tensor whose
    largest absolute difference is at most ``floor`` passes too (float32 rounding on a tensor that stays
    near zero, or a model chaotic under float32 rounding, where a relative bound says nothing). rtol=0 asks
    for the same values. The run's state holds exactly the reference checkpoint's tensors (the rng/ streams
    are left out unless ``rng``). With ``records`` (both sides run directories) the run also logged each step the
    reference logged, once (``redone``: at least once, the later record counting: steps trained again after
    a fallback to a checkpoint), and each step's loss passes the same rule as a one-element tensor.

    RUN, REFERENCE: run directories (their newest checkpoint), or {name: array}; a REFERENCE given as arrays
    (the parameters of an algorithm written plainly) is looked up tensor by tensor in the run's state.

    Note: another number of workers sums a step's gradient in another order; the float32 results differ in
    the last bits, and momentum or a high learning rate amplifies that (docs/exactness.md). A test states
    its own ``rtol`` only where its model needs one.
    """
    got = final_state(Path(run), rng) if isinstance(run, (str, Path)) else dict(run)
    want = final_state(Path(reference), rng) if isinstance(reference, (str, Path)) else dict(reference)
    if not rng:
        got = {n: v for n, v in got.items() if not n.startswith("rng/")}
        want = {n: v for n, v in want.items() if not n.startswith("rng/")}
    both_runs = isinstance(run, (str, Path)) and isinstance(reference, (str, Path))
    if isinstance(reference, (str, Path)):
        assert set(got) == set(want), f"tensors differ: {sorted(set(got) ^ set(want))}"
    missing = sorted(set(want) - set(got))
    assert not missing, f"not in the run's state: {missing}"
    far = [_differs(name, got[name], want[name], rtol, floor) for name in want]
    if both_runs and records:
        logged = [(r["step"], r["loss"]) for r in metrics(Path(run)) if "loss" in r]
        expect = {step: loss for step, loss in ((r["step"], r["loss"]) for r in metrics(Path(reference)) if "loss" in r)}
        steps = [s for s, _ in logged]
        if redone:
            assert sorted(set(steps)) == sorted(expect), f"steps logged {steps}, the reference's {sorted(expect)}"
        else:
            assert steps == sorted(expect), f"every step logged exactly once: {steps}"
        for step, loss in dict(logged).items():
            far.append(_differs(f"loss of step {step}", loss, expect[step], rtol, floor))
    far = [f for f in far if f]
    assert not far, "not the reference's model:\n  " + "\n  ".join(far[:20])


# What a checkpoint's TrainState and a step record say about when, how fast and by whom (micro_step: the
# micro-batches rank 0 ran), not about the model: left out of assert_bitwise's comparison.
CIRCUMSTANCES = {"time", "world_size", "generation", "evaluation_s", "step_time_s", "train_s", "micro_step"}


def assert_bitwise(run: Run, reference: Run) -> None:
    """trainer.reproducible's promise (docs/exactness.md): RUN ended on REFERENCE's bits. Every tensor of the
    final checkpoint (parameters, buffers, optimizer slots) and every step's loss are ``==`` (assert_equivalent with
    rtol=0), and so are the TrainState the checkpoint holds and every evaluation, but for CIRCUMSTANCES."""
    assert_equivalent(run, reference, rtol=0.0)

    def progress(run_dir: Run) -> dict:
        _, meta = ckpt.load_with_metadata(ckpt.latest(Path(run_dir) / "checkpoints"))
        state = {k: meta[k] for k in ("step", "skipped_steps", "loss_scale", "loss_scale_good_steps", "cursor",
                                      "sat_out", "callbacks")}
        state["last_metrics"] = {k: v for k, v in meta["last_metrics"].items() if k not in CIRCUMSTANCES}
        return state

    def evaluations(run_dir: Run) -> dict:  # by step (a run resumed twice also evaluated where each part ended)
        return {r["step"]: {k: v for k, v in r.items() if k not in CIRCUMSTANCES} for r in metrics(Path(run_dir))
                if "eval_loss" in r}

    assert progress(run) == progress(reference)
    want = evaluations(reference)
    assert {step: evaluations(run).get(step) for step in want} == want


def _differs(name: str, got, want, rtol: float, floor: float) -> str:
    """'' where GOT passes the rule against WANT (assert_equivalent's), else what is off."""
    a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if a.shape != b.shape:
        return f"{name}: shape {a.shape}, the reference's {b.shape}"
    diff = a - b
    rel = float(np.linalg.norm(diff) / max(float(np.linalg.norm(b)), 1e-30))
    worst = float(np.abs(diff).max(initial=0.0))
    if rel <= rtol or (floor > 0 and worst <= floor):
        return ""
    return f"{name}: relative difference {rel:.3g} > {rtol:g} (largest absolute difference {worst:.3g})"


# ---------------------------------------------------------------- the 1-worker reference, trained once
def one_worker_run(root: Path, *overrides: str, model: Run = PROBE, common: List[str] = COMMON,
                   record: bool = False, here: bool = False) -> Path:
    """The 1-worker run of MODEL with COMMON + OVERRIDES, trained once per test session and cached under
    ROOT (conftest's ``one_worker`` fixture passes the session's folder): its run directory.

    Keyed by what it is trained with. Safe with pytest-xdist: the first process to lock the key trains it
    while the others wait on the lock; a run that failed or was cut short leaves no DONE mark and is
    trained again. ``record``: with EF_PROBE_RECORD (under TensorFlow the probes inject at the data fetch,
    which records). ``here``: trained in this process (fit_here), not by the CLI in a new one: a torch job
    saves the ~3 s of an interpreter that imports torch, Hydra and the trainer again, and those of the model
    file's own imports (peft, dynamo) after the first; the same trainer, so the same run (not with record)."""
    assert not (here and record), "record= sets the probe's environment for a CLI job"
    key = json.dumps({"model": str(model), "args": [*common, *overrides], "record": record,
                      **({"here": True} if here else {})})
    folder = Path(root) / hashlib.sha1(key.encode()).hexdigest()[:16]
    run = folder / "run"
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (folder / "DONE").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            env = {}
            if record:
                (folder / "record").mkdir()
                env["EF_PROBE_RECORD"] = str(folder / "record")
            if here:
                fit_here(model, run, "trainer.progress=false", *common, *overrides)
            else:
                train_ok(run, *overrides, env=env, model=model, common=common, timeout=600)
            (folder / "DONE").write_text(key)
    return run


# ---------------------------------------------------------------- topology=local_sgd|diloco, written plainly
def plain_rounds(kind: str, replicas: int, every: int, steps: int, outer_lr: float = 0.7, momentum: float = 0.9,
                 batch: int = 64, lr: float = 0.1, seed: int = 0):
    """The algorithm, plainly: digits_mlp's parameters and forward, each epoch's permutation (the seeded
    order every ElasticFlow run uses) cut into global batches, replica k on the k-th of K contiguous parts of
    each with a fresh torch.optim.SGD each round, rounds of ``every`` steps (the last one shorter). Returns
    (final parameters by name, the loss of every step: the mean over the global batch)."""
    import torch
    import torch.nn.functional as F

    if str(MODELS) not in sys.path:
        sys.path.insert(0, str(MODELS))
    import _digits

    x, y = (torch.from_numpy(a) for a in _digits.train_split())
    rng = np.random.default_rng(seed)
    theta = {"hidden/W": rng.normal(0, np.sqrt(2 / 64), (64, 64)), "hidden/b": np.zeros(64),
             "out/W": rng.normal(0, np.sqrt(1 / 64), (64, 10)), "out/b": np.zeros(10)}
    theta = {n: torch.tensor(v, dtype=torch.float32, requires_grad=True) for n, v in theta.items()}
    outer = torch.optim.SGD(theta.values(), lr=outer_lr, momentum=momentum, nesterov=True)
    n = len(x)
    stream = [(torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(n)), lo, min(lo + batch, n))
              for epoch in range(steps // (n // batch) + 1) for lo in range(0, n, batch)][:steps]
    losses = []
    for first in range(0, steps, every):
        batches = stream[first:first + every]
        moves, round_losses = [], np.zeros(len(batches))
        for k in range(replicas):
            mine = {name: t.detach().clone().requires_grad_(True) for name, t in theta.items()}
            inner = torch.optim.SGD(mine.values(), lr=lr)
            for j, (order, lo, hi) in enumerate(batches):
                sizes = [len(a) for a in np.array_split(np.arange(hi - lo), replicas)]
                ids = order[lo + sum(sizes[:k]):lo + sum(sizes[:k + 1])]
                h = torch.relu(x[ids] @ mine["hidden/W"] + mine["hidden/b"])
                loss = F.cross_entropy(h @ mine["out/W"] + mine["out/b"], y[ids])
                inner.zero_grad()
                loss.backward()
                inner.step()
                round_losses[j] += float(loss.detach()) * sizes[k] / (hi - lo)
            moves.append({name: theta[name].detach() - mine[name].detach() for name in theta})
        with torch.no_grad():
            for name, t in theta.items():
                mean = sum(m[name] for m in moves) / replicas
                if kind == "local_sgd":
                    t.sub_(mean)
                else:
                    t.grad = mean
        if kind == "diloco":
            outer.step()
        losses.extend(round_losses)
    return {n: t.detach().numpy() for n, t in theta.items()}, losses


# ---------------------------------------------------------------- the exact probe (BatchNorm, dropout)
EXACT = Path(__file__).parent / "models" / "exact_probe.py"
# Plain SGD: momentum amplifies float32 summation-order noise. elastic.wait_s=300: the job starts once every
# worker it launched has arrived, however long a loaded machine takes to import TensorFlow in each.
EXACT_COMMON = ["trainer.global_batch_size=64", "trainer.micro_batch_size=16", f"trainer.max_steps={STEPS}",
                "trainer.log_every=1", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5",
                "elastic.wait_s=300", "optimizer.lr=0.1"]
EXACT_KINDS = {"torch_bn": "backend=torch", "dict_dropout_torch": "backend=torch",
               "keras_bn": "backend=tensorflow", "dict_dropout_tf": "backend=tensorflow"}


def exact_overrides(kind: str) -> List[str]:
    """The overrides that pick one of tests/models/exact_probe.py's models (EXACT_KINDS)."""
    return [EXACT_KINDS[kind], f"+model_args.kind={kind.replace('_torch', '').replace('_tf', '')}"]


def exact_reference(one_worker: Callable, kind: str) -> Path:
    """The cached 1-worker run of the exact probe's model KIND (ONE_WORKER: conftest's fixture)."""
    return one_worker(*exact_overrides(kind), model=EXACT, common=EXACT_COMMON,
                      record="tensorflow" in EXACT_KINDS[kind])


def start_exact(run_dir: Path, kind: str, *overrides: str, env: Optional[dict] = None) -> subprocess.Popen:
    """start() for the exact probe's model KIND (a TensorFlow kind records beside the run: its faults are
    injected at the fetch, as forward() runs only while tracing)."""
    env = dict(env or {})
    if "tensorflow" in EXACT_KINDS[kind]:
        record = Path(run_dir).parent / f"{Path(run_dir).name}-record"
        record.mkdir(parents=True, exist_ok=True)
        env["EF_PROBE_RECORD"] = str(record)
    return start(run_dir, *exact_overrides(kind), *overrides, env=env, model=EXACT, common=EXACT_COMMON)


def train_exact(run_dir: Path, kind: str, *overrides: str, env: Optional[dict] = None) -> str:
    proc = start_exact(run_dir, kind, *overrides, env=env)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    return out


def assert_replicas_hold_the_checkpoint(run_dir: Path, dumps: Path, kind: str) -> None:
    """Every buffer a worker dumped as it ended (EF_PROBE_DUMP) is the final checkpoint's, bit for bit."""
    if kind.startswith("dict"):
        return  # no buffers
    final = final_state(run_dir, rng=False)
    files = sorted(dumps.glob("*.npz"))
    assert files, "no worker dumped its buffers"
    for f in files:
        with np.load(f) as held:
            for name in held.files:
                key = name if name in final else next((k for k in final if name.endswith("/" + k)), None)
                assert key is not None, f"{name} not in the checkpoint"
                np.testing.assert_array_equal(held[name], final[key], err_msg=f"{f.name}: {name}")


# ---------------------------------------------------------------- launcher=nodes on tests/hosts.py's hosts
TOKEN = "3f1c9a7be2d4405f8c6a1d2e9b7f0a53"
ENDPOINT = "10.231.0.1:29400"


def nodes_args(*extra: str) -> list:
    return [*COMMON, "launcher=nodes", f"launcher.endpoint={ENDPOINT}", "launcher.procs_per_node=2", *extra]


def start_on_hosts(net, run: Path, hosts_: list, *extra: str, env: Optional[dict] = None,
                   record: Optional[Path] = None) -> Dict[str, subprocess.Popen]:
    """The same `elasticflow train PROBE launcher=nodes` on each host (h1 owns the endpoint); {host: process}."""
    env = {"ELASTICFLOW_JOB_TOKEN": TOKEN, **(env or {}), **({"EF_PROBE_RECORD": str(record)} if record else {})}
    # Every host names the same run directory: it is on the filesystem they share.
    return {h: net.train(h, PROBE, run, *nodes_args(*extra), env=env) for h in hosts_}


# ---------------------------------------------------------------- model files
SLOW = Path(__file__).parent / "models" / "slow_steps.py"  # steps of 0.05 s: still training when a test acts

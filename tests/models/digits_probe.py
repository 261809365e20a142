"""The digits MLP with fault injection and a sample recorder, for the elastic tests.

Environment (read by every worker):
    EF_PROBE_KILL    "worker:step:where[,worker:step:where...]": that worker SIGKILLs itself at that
                     step, where = "forward" (inside forward; workers killed there at the same step wait for
                     each other first, so they die in the same generation) or "reduction" (a timer fires while it
                     waits in the gradient allreduce; the other workers are slowed at that step so it
                     is the one waiting), or "logging" (as rank 0, when it writes step's record to
                     metrics.jsonl -- during the next step's reduction -- it waits 0.3 s, long enough for
                     the others to finish that reduction, and dies before the record is written), or "sync"
                     (its first state sync with peers, ``Replica.sync_state`` as it joins; step is not read:
                     it dies there before it sends, so its peers' first sync fails while they wait for it).
    EF_PROBE_PAUSE   "step:seconds": every worker sleeps that long in forward at that step (generation 0),
                     a window for a test to kill a pid from workers.json.
    EF_PROBE_SLEEP   seconds to sleep in every forward (spreads steps out for random kills).
    EF_PROBE_SPIN    seconds of CPU time every micro-batch's forward burns (compute a SIGSTOPped worker does not
                     make: a worker duty-cycled from outside is slower by as much, tests/test_straggler.py).
    EF_PROBE_DEVICE  seconds every micro-batch's forward sleeps: a device's compute, which leaves the host's CPU free
                     (scripts/bench/bench_failure_rate.py: 4 workers on 2 cores then behave as 4 devices).
    EF_PROBE_PACE    a file path: with it set, EF_PROBE_SLEEP applies only while that file exists (a soak
                     paces the job while it injects faults, then lets it run to the end at full speed).
    EF_PROBE_HOLD    a file path: forward blocks while that file exists (a test holds training still
                     while it scales or kills, then removes the file).
    EF_PROBE_LIMIT   a file path: while it exists, the forward of a step past the number it holds blocks (a
                     test lets training go exactly as far as it needs, so a fixed-length job cannot end
                     before the test has acted; it removes the file to let the job run to its end).
                     A worker waiting at a hold or a limit marks itself with the file <path>.held-<pid>.
    EF_PROBE_STALL_BUILD "worker:seconds:file": that worker, about to build the gloo group of its first
                     generation with peers, writes its pid and that generation to file and waits first, until
                     the test removes the file (at most that many seconds): it arrived, heartbeats, and never
                     connects (the others' rendezvous times out). The test may SIGSTOP it meanwhile.
    EF_PROBE_SLOW_START "first_id:seconds": workers with that id or higher (joiners) sleep that long when
                     the model file loads, before they ask to join.
    EF_PROBE_MISCOMPUTE "worker:step": that worker's device computes wrongly at that step (every attempt of it):
                     its forward scales the inputs by 1 + 2^-10, a wrong gradient stored correctly
                     (tests/test_fingerprint.py's spot check).
    (Under backend=tensorflow set EF_PROBE_RECORD: the injections then happen at the data fetch.)
    EF_PROBE_RECORD  a directory: every fetch appends {pid, worker, generation, step, epoch, replica, ids} to
                     <dir>/<pid>.jsonl -- the sample ids this worker consumed for that step attempt; and
                     (torch) every step attempt's first forward appends {pid, worker, generation, step,
                     params} to <dir>/params/<pid>.jsonl -- a CRC32 of the parameters it starts from.
"""
import json
import os
import signal
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np

import elasticflow
from elasticflow.distributed.protocol import ENV_RUN_DIR, ENV_WORKER_ID

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import digits_mlp  # noqa: E402

WORKER = int(os.environ.get(ENV_WORKER_ID, "0"))
KILLS = [tuple(k.split(":")) for k in os.environ.get("EF_PROBE_KILL", "").split(",") if k]
PAUSE = tuple(float(v) for v in os.environ["EF_PROBE_PAUSE"].split(":")) if os.environ.get("EF_PROBE_PAUSE") else None
SLEEP = float(os.environ.get("EF_PROBE_SLEEP", "0"))
SPIN = float(os.environ.get("EF_PROBE_SPIN", "0"))
DEVICE = float(os.environ.get("EF_PROBE_DEVICE", "0"))
MISCOMPUTE = tuple(int(v) for v in os.environ["EF_PROBE_MISCOMPUTE"].split(":")) \
    if os.environ.get("EF_PROBE_MISCOMPUTE") else None
PACE = os.environ.get("EF_PROBE_PACE")
HOLD = os.environ.get("EF_PROBE_HOLD")
LIMIT = os.environ.get("EF_PROBE_LIMIT")
RECORD = os.environ.get("EF_PROBE_RECORD")
STALL = os.environ.get("EF_PROBE_STALL_BUILD", "").split(":") if os.environ.get("EF_PROBE_STALL_BUILD") else None
_seen_steps = set()
_params_seen = set()  # (step, generation) attempts whose parameters were recorded

model = digits_mlp.model
eval_data = None


def _kill_self():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _inject(ctx):
    first_time = (ctx.step, ctx.generation) not in _seen_steps
    _seen_steps.add((ctx.step, ctx.generation))
    if not first_time:
        return  # only the first micro-batch of a step attempt
    for worker, step, where in KILLS:
        if int(step) != ctx.step or where in ("logging", "sync"):
            continue
        if int(worker) == WORKER:
            if where == "forward":
                _meet_the_other_victims(step)
                _kill_self()
            threading.Timer(0.15, _kill_self).start()  # fires while we wait in the allreduce
        elif where == "reduction":
            time.sleep(0.4)  # the victim reaches the allreduce first and dies there
    if PAUSE and ctx.step == int(PAUSE[0]) and ctx.generation == 0:
        time.sleep(PAUSE[1])
    if SLEEP and (not PACE or os.path.exists(PACE)):
        time.sleep(SLEEP)
    deadline = time.monotonic() + 120
    if HOLD and ctx.step > 0:
        _wait_marked(HOLD, lambda: os.path.exists(HOLD), deadline)
    if LIMIT:
        _wait_marked(LIMIT, lambda: ctx.step > _allowed(LIMIT), deadline)


def _wait_marked(path, blocked, deadline):
    """Wait in forward while ``blocked()``, marked meanwhile by the file PATH.held-<pid> (harness.held: who
    waits there now; at a Limit every worker ends up waiting at the same step, none ahead in a collective)."""
    if not blocked():
        return
    mark = Path(f"{path}.held-{os.getpid()}")
    mark.touch()
    while blocked() and time.monotonic() < deadline:
        time.sleep(0.01)
    mark.unlink(missing_ok=True)


def _meet_the_other_victims(step):
    """Workers killed in forward at the same step die in the same generation: each waits, in forward, until
    all have arrived (files in RUN_DIR/.probe), or a late one would regroup on the first death and die in the
    next generation (a loaded machine did this: test_two_neighbours_killed_fall_back_to_the_checkpoint)."""
    victims = [w for w, s, where in KILLS if s == step and where == "forward"]
    if len(victims) < 2:
        return
    folder = Path(os.environ[ENV_RUN_DIR]) / ".probe"
    folder.mkdir(exist_ok=True)
    (folder / f"{step}-{WORKER}").touch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all((folder / f"{step}-{w}").exists() for w in victims):
        time.sleep(0.01)


def _allowed(path):
    """The last step EF_PROBE_LIMIT's file lets run (every step once it is gone; none while it is torn)."""
    try:
        return int(Path(path).read_text())
    except FileNotFoundError:
        return float("inf")
    except ValueError:
        return 0


def _stall_first_build():
    from elasticflow.distributed.comm import comm

    build = comm.Group.__init__
    stalled = []

    def stalling(self, store, generation, rank, world, *args, **kwargs):
        if world > 1 and not stalled:
            stalled.append(generation)
            Path(STALL[2]).write_text(json.dumps({"pid": os.getpid(), "generation": generation}))
            deadline = time.monotonic() + float(STALL[1])
            while os.path.exists(STALL[2]) and time.monotonic() < deadline:
                time.sleep(0.01)
        build(self, store, generation, rank, world, *args, **kwargs)

    comm.Group.__init__ = stalling


def _kill_in_first_sync():
    """The victim dies in its first state sync once every member of its generation is in that sync (files in
    RUN_DIR/.probe, as _meet_the_other_victims): had it died while the others still built the group, the agent's
    next generation would supersede that group before it formed, and no first sync would fail (a loaded machine
    did this in CI)."""
    from elasticflow.replica import replica

    sync = replica.Replica.sync_state
    victim = any(where == "sync" and int(worker) == WORKER for worker, _, where in KILLS)

    def meeting(self, samples_seen):
        if self.world > 1:
            folder = Path(os.environ[ENV_RUN_DIR]) / ".probe"
            folder.mkdir(exist_ok=True)
            (folder / f"sync-g{self.generation}-{WORKER}").touch()
            if victim:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and len(list(folder.glob(f"sync-g{self.generation}-*"))) < self.world:
                    time.sleep(0.01)
                _kill_self()
        return sync(self, samples_seen)

    replica.Replica.sync_state = meeting


def _kill_while_logging(steps):
    from elasticflow.observability import reporting

    write = reporting.RunLog.step

    def dying(self, record):
        if record.get("step") in steps:
            time.sleep(0.3)
            _kill_self()
        write(self, record)

    reporting.RunLog.step = dying


if any(where == "logging" and int(worker) == WORKER for worker, _, where in KILLS):
    _kill_while_logging({int(step) for worker, step, where in KILLS if where == "logging" and int(worker) == WORKER})
if any(where == "sync" for _, _, where in KILLS):  # every worker: the victim waits for all in the sync
    _kill_in_first_sync()
if STALL and int(STALL[0]) == WORKER:
    _stall_first_build()
if os.environ.get("EF_PROBE_SLOW_START"):
    _first, _seconds = os.environ["EF_PROBE_SLOW_START"].split(":")
    if WORKER >= int(_first):
        time.sleep(float(_seconds))


def forward(x, y, params):
    ctx = elasticflow.context()
    if RECORD and (ctx.step, ctx.generation) not in _params_seen:
        _params_seen.add((ctx.step, ctx.generation))
        _record_params(ctx, params)
    _inject(ctx)
    if DEVICE:
        time.sleep(DEVICE)
    if SPIN:  # CPU time, not wall time: a stopped process makes none
        until = time.thread_time() + SPIN
        while time.thread_time() < until:
            pass
    if MISCOMPUTE is not None and MISCOMPUTE == (WORKER, ctx.step):
        x = x * (1 + 2 ** -10)
    return digits_mlp.forward(x, y, params)


def _record_params(ctx, params):
    """A checksum of the parameters this worker starts the step attempt from: the members of the
    generation that commits a step must all start it from the same parameters."""
    digest = 0
    for layer in sorted(params):
        for name in sorted(params[layer]):
            v = params[layer][name]
            if not hasattr(v, "detach"):
                return  # TensorFlow: forward() runs as Python only while tf.function traces (symbolic tensors)
            digest = zlib.crc32(np.ascontiguousarray(v.detach().cpu().numpy()).tobytes(), digest)
    line = {"pid": os.getpid(), "worker": WORKER, "generation": ctx.generation, "step": ctx.step, "params": digest}
    folder = Path(RECORD) / "params"  # beside, not among, the fetch records the tests read
    folder.mkdir(exist_ok=True)
    with open(folder / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


class RecordingDataset:
    """The digits training split as an indexable dataset that logs every fetch."""

    def __init__(self, arrays):
        self.x, self.y = arrays
        self.ids = np.arange(len(self.x))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        # Under TensorFlow's tf.function, forward() runs as Python only while tracing; the fetch
        # runs every step, so faults are injected here too (once per step attempt either way).
        _inject(elasticflow.context())
        if RECORD:
            ctx = elasticflow.context()
            line = {"pid": os.getpid(), "worker": WORKER, "generation": ctx.generation, "step": ctx.step,
                    "epoch": ctx.epoch, "replica": ctx.replica, "ids": self.ids[indices].tolist()}
            with open(Path(RECORD) / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return self.x[indices], self.y[indices]


def data(cfg):
    arrays = digits_mlp.data(cfg)
    if not RECORD:
        return arrays
    # A record means "what this worker consumed for that step attempt", written at the fetch: so fetch
    # on demand, not ahead (tests/test_data_forms.py checks exactly-once with prefetch from forward()).
    cfg.data.prefetch = 0
    return RecordingDataset(arrays)

"""Chaos soak (issue #13): random faults against a running elastic job for a bounded time, then proof
that it finished with the model one worker trains, used every sample once, and formed every
generation within its timeouts.

    .venv/bin/python scripts/soak/chaos.py --events 8 --seed 1 --step-sleep 0.2   # tests/test_chaos.py runs this
    .venv/bin/python scripts/soak/chaos.py --duration 60 --seed 1 --min-events 20
    .venv/bin/python scripts/soak/chaos.py --duration 600 --seed 13    # the long soak (docs/benchmarks.md)

The job: ``elasticflow train tests/models/digits_probe.py`` (digits MLP, SGD lr 0.05, global batch 64,
every step logged) with launcher.workers=3 min_workers=2 max_workers=4, elastic.timeout_s=15,
heartbeat_timeout_s=5, wait_s=60. While the soak runs every forward sleeps ``--step-sleep`` seconds
(EF_PROBE_PACE) and trainer.max_steps = duration / step-sleep, so the job cannot end before the soak
does; then the pace is lifted and it trains to its end at full speed. ``--events N`` counts the faults
instead of timing them: N events, every family (kill, stop_short, stop_long or stop_retiring, scale) among
them, the last ones going to the families still missing; the job's last 10 steps wait for the soak
(EF_PROBE_LIMIT), so a loaded machine delays the faults and never skips one (the suite's soak).

Events, one every 1-5 s, half of them chained to the one before (0.05-0.5 s after it, or the moment
workers.json shows the next generation: during a recovery, a joiner's state transfer, a forming group):
  kill         SIGKILL a live worker: a member, a joiner still starting, one left waiting, one retiring
  stop_short   SIGSTOP a member for 0.1-0.5x heartbeat_timeout_s, then SIGCONT: peers wait, nobody is cut out
  stop_long    SIGSTOP a member or a waiting worker for 1.3-2x heartbeat_timeout_s: the agent must cut it out
  stop_retiring  the same, the moment workers.json shows a worker retired by a scale-down (it is still in
               the current group until the step boundary: its peers wait for it in the allreduce)
  stop_joiner  SIGSTOP a starting worker for longer than elastic.timeout_s (no heartbeat before it joins)
  scale        `elasticflow scale RUN --workers N`, N in [min_workers, max_workers]; `--wait 0` or `--wait 30`
  scale_pair   scale to 2 more at once: the second join arrives while the first one's generation forms
  restore      scale back to min_workers..max_workers when fewer than min_workers are left
The job is kept alive: a kill or a long stop never takes the last live worker that holds the training
state (a member of a generation that committed a step), nor, with parameter_server, the last live holder of
a shard (topology.replica=2 keeps a standby for one loss at a time).

Checks: the job exits 0; its final parameters equal an uninterrupted 1-worker run's (per tensor
||got - want|| / ||want|| <= 1e-5; with --topology diloco, <= 3x what rounding alone does to the 1-worker run,
measured as the same run on 1 thread against 2, when that is more: its outer momentum amplifies rounding); metrics.jsonl logs steps 1..N once each with the data cursor
(epoch, samples_seen) of the fixed global order, and the sample ids the workers fetched in each
step's committing generation (the probe's records under RUN_DIR/samples/) are exactly that step's
slice of the epoch's permutation: every sample of every epoch once; the members of that generation
started the step from the same parameters (the probe's checksums under RUN_DIR/samples/params/); every
generation formed or was superseded within 2 x elastic.timeout_s + 2.5 s of its publish (arrival,
then the gloo rendezvous, each bounded by timeout_s); the newest formed; only stopped workers were cut out as hung, and every
worker that left was one the soak killed or the agent cut out.

Seeded: ``--seed`` replays the same choices (targets, kinds, durations), not the same timings.
Exit 0 when every check passed, 1 otherwise; 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from elasticflow._util.fileio import read_jsonl as jsonl  # noqa: E402  (skips the line a SIGKILLed writer tore)
PROBE = REPO / "tests" / "models" / "digits_probe.py"
CLI = [sys.executable, "-m", "elasticflow.cli"]
RTOL = 1e-5
# --reproducible: the job and its reference in trainer.reproducible (docs/exactness.md), held to the same bits
REPRODUCIBLE = ["trainer.reproducible=true", "trainer.micro_batch_size=16"]
MIN_W, START_W, MAX_W = 2, 3, 4
TIMEOUT_S, HEARTBEAT_S, WAIT_S = 15.0, 5.0, 60.0
FORM_SLACK_S = 2.5      # beyond 2 x timeout_s: rendezvous.REPORT_WINDOW_S (0.5 s), health ticks, a loaded machine
KINDS = {"kill": 25, "stop_short": 20, "stop_long": 10, "stop_joiner": 5, "scale": 30, "scale_pair": 10}
# --events: the families every counted soak fires at least once (a kind of each counts for its family). A
# scale_pair does not stand for `scale`: tests/test_chaos.py requires a plain one, and the coverage must give it.
FAMILIES = {"kill": ("kill",), "stop_short": ("stop_short",), "stop_long": ("stop_long", "stop_retiring"),
            "scale": ("scale",)}
EVENT_S = 5.0  # --events: the job's paced steps allow this many seconds per event (they come every 1-5 s)


def common(steps: int) -> List[str]:
    # lr 0.05, not 0.1: at 0.1 the digits MLP's trajectory has a fork between steps 600 and 1200 where a
    # float32 rounding difference in the gradient sum (any other summation order: more workers, or one
    # worker with trainer.micro_batch_size=16) sends it onto a neighbouring path that ends 1.95e-4 away.
    # Measured: 10 of 40 runs with 1e-7 relative noise per step took it; at 0.05, 0 of 40, and 11
    # summation orders (micro-batches 4..40, 2-4 workers) all ended within 7.1e-7 (2026-11-25;
    # docs/benchmarks/history.md, "Rounding forks and the chaos soak").
    return [f"trainer.max_steps={steps}", "trainer.global_batch_size=64", "trainer.log_every=1",
            "trainer.progress=false", "optimizer.lr=0.05"]


def elastic() -> List[str]:
    return [f"launcher.workers={START_W}", f"launcher.min_workers={MIN_W}", f"launcher.max_workers={MAX_W}",
            f"elastic.timeout_s={TIMEOUT_S:g}", f"elastic.heartbeat_timeout_s={HEARTBEAT_S:g}",
            f"elastic.wait_s={WAIT_S:g}"]


def steps_logged(run: Path) -> List[dict]:
    return [r for r in jsonl(run / "metrics.jsonl") if "loss" in r]


def final_params(run: Path) -> Dict[str, np.ndarray]:
    import elasticflow.checkpoint as ckpt

    state = ckpt.load(ckpt.latest(run / "checkpoints"))
    return {k: np.asarray(v) for k, v in state.items() if not k.startswith("rng/")}


def start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks (/proc/PID/stat field 22): tells a pid from its reuse."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Soak:
    """One soak: the job, the events fired at it, and the bookkeeping the checks need."""

    def __init__(self, run: Path, duration: float, step_sleep: float, seed: int, min_events: int = 0,
                 topology: str = "ring", reproducible: bool = False, events: int = 0):
        self.run, self.duration, self.rng = run, duration, random.Random(seed)
        self.reproducible = reproducible
        self.mode = REPRODUCIBLE if reproducible else []  # the job's and the reference's
        # hierarchical on one host: groups of 2 local slots (topology.group_size), so that the soak's 2-4
        # workers form 1-2 groups, and kills hit leaders and plain members alike
        # diloco: 4 replicas over the soak's 2-4 workers (a worker trains one or two, or waits), rounds of 4 steps
        # parameter_server: one shard with a standby: 2 aggregators and 1-2 trainers (2 workers: no standby)
        self.topology = [f"topology={topology}"] + {"hierarchical": ["topology.group_size=2"],
                                                    "diloco": ["topology.replicas=4", "topology.sync_every=4"],
                                                    "parameter_server": ["topology.replica=2"],
                                                    }.get(topology, [])
        self.min_events, self.events = min_events, events
        # With a floor of events the faults may go on for up to twice the duration: the job must outlast them.
        # Counted (--events), the job's paced steps last EVENT_S an event; EF_PROBE_LIMIT holds it short of
        # its end while events are still due, so a slow machine delays the faults but never skips them.
        seconds = events * EVENT_S if events else duration * (2 if min_events else 1)
        self.steps = max(50, int(seconds / step_sleep))
        self.limit = run.parent / f"{run.name}.limit"
        self.pace = run.parent / f"{run.name}.pace"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "EF_PROBE_SLEEP": str(step_sleep),
                    "EF_PROBE_PACE": str(self.pace), "EF_PROBE_RECORD": str(run / "samples"),
                    **({"EF_PROBE_LIMIT": str(self.limit)} if events else {}),
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.proc: Optional[subprocess.Popen] = None
        self.log: List[dict] = []                 # the events fired
        self.seen: Dict[int, str] = {}            # pid -> start time, every worker pid ever listed
        self.killed: set = set()                  # pids this soak SIGKILLed
        self.stopped: Dict[int, float] = {}       # pid -> when to SIGCONT it
        self.ever_stopped: set = set()
        self.doomed: set = set()                  # stopped past the heartbeat timeout: the agent kills them
        self.retirees: set = set()                # retiring pids already considered for stop_retiring
        self.scales: List[tuple] = []             # (Popen, started, target)
        self.scale_results: Counter = Counter()
        self.t0 = 0.0

    # ------------------------------------------------------------------ the job
    def start(self) -> None:
        (self.run / "samples").mkdir(parents=True)
        self.pace.touch()
        if self.events:
            self.limit.write_text(str(self.steps - 10))  # the last 10 steps wait for the soak's settle
        # The job's output goes to a file, not a pipe read at the end: a pipe nobody reads fills (64 KiB) and
        # every write to it blocks, in the agent and in every worker that inherited it.
        self.output = self.run.parent / "job.log"
        with open(self.output, "w") as out:
            self.proc = subprocess.Popen(CLI + ["train", str(PROBE), f"hydra.run.dir={self.run}",
                                                *common(self.steps), *elastic(), *self.topology, *self.mode],
                                         env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def snapshot(self) -> dict:
        try:
            snap = json.loads((self.run / "workers.json").read_text())
        except (OSError, ValueError):
            return {"generation": -1, "members": [], "joining": [], "retiring": [], "waiting": []}
        for role in ("members", "joining", "retiring", "waiting"):
            for w in snap.get(role, []):
                w["role"] = role
                if w["pid"] not in self.seen:
                    self.seen[w["pid"]] = start_time(w["pid"])
        return snap

    def alive(self, snap: dict, roles=("members", "joining", "waiting", "retiring")) -> List[dict]:
        """Listed workers neither killed by us nor doomed by a long stop."""
        return [w for r in roles for w in snap.get(r, []) if w["pid"] not in self.killed | self.doomed
                and self.seen.get(w["pid"]) is not None and start_time(w["pid"]) == self.seen[w["pid"]]]

    def veterans(self) -> set:
        """Worker ids that hold the training state: members of a generation that committed a step."""
        published = {e["generation"]: e["members"] for e in jsonl(self.run / "events.jsonl")
                     if e["event"] == "generation"}
        committed = {r.get("generation") for r in steps_logged(self.run)[-200:]}
        return {wid for g in committed for wid in published.get(g, [])}

    def server_role(self, worker_id: int) -> Dict[str, str]:
        """parameter_server: the worker's role in the newest roles event, as a note's field (else nothing)."""
        roles = [e for e in jsonl(self.run / "events.jsonl") if e["event"] == "roles"]
        if "topology=parameter_server" not in self.topology or not roles:
            return {}
        r = roles[-1]
        names = {"primaries": "primary", "standbys": "standby", "trainers": "trainer"}
        return {"as": next((name for k, name in names.items() if worker_id in r[k]), "new")}

    def sole_holders(self, alive: List[dict]) -> set:
        """parameter_server: the aggregators left alone holding their shard (the newest roles event, less the
        workers the soak took): a kill would lose the shard and send the job back to a checkpoint, which
        replica 2 promises for one loss at a time, not two."""
        roles = [e for e in jsonl(self.run / "events.jsonl") if e["event"] == "roles"]
        if not roles:
            return set()
        r, ids = roles[-1], {w["worker_id"] for w in alive}
        sole = set()
        for i, p in enumerate(r["primaries"]):
            live = [w for w in [p] + r["standbys"][i:i + 1] if w in ids]
            if len(live) == 1:
                sole |= set(live)
        return sole

    def signal(self, pid: int, sig: int) -> bool:
        if start_time(pid) != self.seen.get(pid):
            return False  # gone (and maybe its pid reused): never signal a stranger
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    # ------------------------------------------------------------------ events
    def fire(self, snap: dict, chained: bool) -> None:
        alive = self.alive(snap)
        staying = [w for w in alive if w["role"] != "retiring"]
        holders = {w["worker_id"] for w in alive if w["role"] in ("members", "waiting")} & self.veterans()
        # A kill or a long stop must leave a state holder alive, or the job would restart from scratch.
        sole = self.sole_holders(alive)
        killable = [w for w in alive if holders - {w["worker_id"]} and w["worker_id"] not in sole]
        members = [w for w in alive if w["role"] == "members" and w["pid"] not in self.stopped]
        if len([w for w in alive if w["role"] == "members"]) < MIN_W:
            # Below min_workers the agent stops the job after elastic.wait_s: the joiners that restore it are spared.
            killable = [w for w in killable if w["role"] != "joining"]
        idle = [w for w in alive if w["role"] == "waiting" and w["pid"] not in self.stopped]
        starting = [w for w in alive if w["role"] == "joining" and w["state"] == "joining"
                    and w["pid"] not in self.stopped and len(members) >= MIN_W]
        scaling = sum(p.poll() is None for p, _, _ in self.scales) >= 2  # two at once, no more
        choices = {k: wt for k, wt in KINDS.items() if {
            "kill": killable, "stop_short": members, "stop_long": [w for w in members + idle if w in killable],
            "stop_joiner": starting, "scale": not scaling, "scale_pair": not scaling and len(staying) + 2 <= MAX_W,
        }[k]}
        missing = self.missing_families()
        if missing and self.events - len(self.log) <= len(missing):
            # the last events go to the families not fired yet (when none of them can fire now, wait)
            choices = {k: wt for k, wt in choices.items() if any(k in FAMILIES[f] for f in missing)}
        if not choices:
            return
        kind = self.rng.choices(list(choices), weights=list(choices.values()))[0]
        if kind == "kill":
            w = self.rng.choice(killable)
            if self.signal(w["pid"], signal.SIGKILL):
                self.killed.add(w["pid"])
                self.note(kind, chained, worker=w["worker_id"], pid=w["pid"], role=w["role"], state=w["state"],
                          **self.server_role(w["worker_id"]))
        elif kind.startswith("stop"):
            pool = {"stop_short": members, "stop_long": [w for w in members + idle if w in killable],
                    "stop_joiner": starting}[kind]
            self.stop(self.rng.choice(pool), kind, chained)
        elif kind == "scale":
            self.scale(self.rng.randint(MIN_W, MAX_W), kind, self.rng.choice([0, 0, 30]), chained)
        else:
            self.scale(len(staying) + 2, kind, 0, chained)

    def missing_families(self) -> List[str]:
        """--events: the families of FAMILIES no event of this soak belonged to yet."""
        if not self.events:
            return []
        fired = {e["kind"] for e in self.log}
        return [f for f, kinds in FAMILIES.items() if not fired & set(kinds)]

    def stop(self, w: dict, kind: str, chained: bool) -> None:
        seconds = {"stop_short": HEARTBEAT_S * self.rng.uniform(0.1, 0.5),
                   "stop_joiner": TIMEOUT_S + self.rng.uniform(1.0, 5.0)}.get(kind, HEARTBEAT_S * self.rng.uniform(1.3, 2.0))
        if self.signal(w["pid"], signal.SIGSTOP):
            self.stopped[w["pid"]] = time.monotonic() + seconds
            self.ever_stopped.add(w["pid"])
            if kind in ("stop_long", "stop_retiring"):
                self.doomed.add(w["pid"])
            self.note(kind, chained, worker=w["worker_id"], pid=w["pid"], role=w["role"], seconds=round(seconds, 2))

    def retiring(self, snap: dict) -> None:
        """Half the workers retired by a scale-down are stopped the moment workers.json lists them."""
        for w in self.alive(snap, roles=("retiring",)):
            if w["pid"] not in self.retirees | set(self.stopped):
                self.retirees.add(w["pid"])
                if self.rng.random() < 0.5 and w["worker_id"] not in self.sole_holders(self.alive(snap)):
                    self.stop(w, "stop_retiring", True)

    def restore(self, snap: dict) -> None:
        """Fewer than min_workers left (counting joiners): scale back up, unless a restore is under way.
        The agent waits elastic.wait_s for them; a join takes ~5-10 s here."""
        staying = [w for w in self.alive(snap) if w["role"] != "retiring"]
        if len(staying) < MIN_W and not any(p.poll() is None and kind == "restore" for p, _, kind in self.scales):
            self.scale(self.rng.randint(MIN_W, MAX_W), "restore", 0, False)

    def scale(self, target: int, kind: str, wait: int, chained: bool) -> None:
        p = subprocess.Popen(CLI + ["scale", str(self.run), "--workers", str(target), "--wait", str(wait)],
                             env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.scales.append((p, time.monotonic(), kind))
        self.note(kind, chained, workers=target, wait=wait)

    def note(self, kind: str, chained: bool, **fields) -> None:
        entry = {"t": round(time.monotonic() - self.t0, 2), "kind": kind, "chained": chained, **fields}
        self.log.append(entry)
        print("  " + " ".join(f"{k}={v}" for k, v in entry.items()), flush=True)

    def tick(self) -> None:
        """SIGCONT the stops that are due; reap finished `scale` commands (each bounded in time)."""
        now = time.monotonic()
        for pid, due in list(self.stopped.items()):
            if now >= due:
                self.signal(pid, signal.SIGCONT)
                del self.stopped[pid]
        for item in list(self.scales):
            p, started, _ = item
            if p.poll() is None and now - started > 120:
                p.kill()
            if p.poll() is not None:
                out = p.communicate()[0]
                self.scales.remove(item)
                # exit 0: reached or "still changing"; 1: a joiner refused / the job ended; 2: refused
                self.scale_results[f"exit {p.returncode}" + (" reached" if "reached" in out else "")] += 1
                if "Traceback" in out:
                    self.scale_results["traceback"] += 1
                    print(out[-2000:], flush=True)

    # ------------------------------------------------------------------ the soak
    def drive(self) -> None:
        deadline = time.monotonic() + 300
        while not steps_logged(self.run) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # faults start once training has: before, no worker holds any state
        self.t0 = time.monotonic()
        end, next_at, follow = self.t0 + self.duration, self.t0 + 1.0, None
        # A loaded machine forms generations slowly, and chained events wait for them: past the duration
        # the faults go on until --min-events have fired, for at most the duration again. Counted (--events):
        # until that many fired, every family among them, bounded only against a soak that cannot go on.
        last = self.t0 + (self.events * 4 * EVENT_S if self.events else self.duration * (2 if self.min_events else 1))

        def going() -> bool:
            if self.events:
                return len(self.log) < self.events or bool(self.missing_families())
            return time.monotonic() < end or len(self.log) < self.min_events
        while self.proc.poll() is None and time.monotonic() < last and going():
            self.tick()
            snap = self.snapshot()
            if snap["generation"] >= 0:
                self.restore(snap)
                self.retiring(snap)
            now = time.monotonic()
            chained = follow is not None and snap["generation"] > follow
            if chained or now >= next_at:
                self.fire(snap, chained)
                follow, r = None, self.rng.random()
                if r < 0.25:
                    next_at = now + self.rng.uniform(0.05, 0.5)
                elif r < 0.5:
                    follow, next_at = snap["generation"], now + 10.0  # or at the next generation
                else:
                    next_at = now + self.rng.uniform(1.0, 5.0)
            time.sleep(0.02)

    def settle(self, timeout: float) -> Optional[str]:
        """Let every stop run to its end, let the scale commands finish, restore min_workers, lift the pace,
        and wait for the job to end. Returns its output (None if it did not end in ``timeout``)."""
        # Each stop runs to its planned end (at most elastic.timeout_s + 5 s): released early, a long stop
        # fired just before the soak ended would not last past the heartbeat timeout it is meant to pass.
        deadline = time.monotonic() + TIMEOUT_S + 10
        while self.stopped and time.monotonic() < deadline:
            self.tick()
            time.sleep(0.05)
        for pid in list(self.stopped):
            self.signal(pid, signal.SIGCONT)
        self.stopped.clear()
        deadline = time.monotonic() + 150
        while any(p.poll() is None for p, _, _ in self.scales) and time.monotonic() < deadline:
            self.tick()
            time.sleep(0.1)
        self.tick()
        time.sleep(2 * HEARTBEAT_S)  # the agent cuts out what a long stop left behind
        if self.proc.poll() is None:
            self.restore(self.snapshot())
        self.pace.unlink(missing_ok=True)
        self.limit.unlink(missing_ok=True)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.tick()
        return self.output.read_text()

    def reap(self) -> None:
        """Leave nothing behind: SIGCONT what we stopped, kill the agent and every worker still alive."""
        for pid in self.ever_stopped:
            self.signal(pid, signal.SIGCONT)
        for p, _, _ in self.scales:
            if p.poll() is None:
                p.kill()
            p.communicate()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # the workers see the agent's port closed and exit (4)
            self.proc.wait()
        time.sleep(1.0)
        for pid in self.seen:
            self.signal(pid, signal.SIGKILL)
        self.pace.unlink(missing_ok=True)
        self.limit.unlink(missing_ok=True)


# ---------------------------------------------------------------------- checks
def replica_starts(run: Path, committed: Dict[int, int]):
    """The parameter checksums each worker began each step from, in the generation that committed it
    (``committed``: step -> generation), and the steps whose members began from different ones."""
    starts: Dict[int, Dict[int, set]] = {}  # step -> worker -> checksums
    for f in (run / "samples" / "params").glob("*.jsonl"):
        for r in jsonl(f):
            if committed.get(r["step"]) == r["generation"]:
                starts.setdefault(r["step"], {}).setdefault(r["worker"], set()).add(r["params"])
    split = sorted(k for k, by_worker in starts.items() if len(set().union(*by_worker.values())) > 1)
    return starts, split


def first_divergence(reference: Path, run: Path) -> str:
    """Where the run left the 1-worker trajectory: the first step whose logged loss differs by more than
    float32 rounding can explain (the loss at step N is computed on the parameters step N-1 made)."""
    want = {r["step"]: r for r in steps_logged(reference)}
    for r in steps_logged(run):
        w = want.get(r["step"])
        if w is not None and abs(r["loss"] - w["loss"]) > 1e-4 * abs(w["loss"]) + 1e-7:
            return (f"; the loss first differs at step {r['step']} ({r['loss']:.6g} vs {w['loss']:.6g}, logged in "
                    f"generation {r.get('generation')} of {r.get('world_size')} worker(s))")
    return "; every logged loss matches"


def relative_difference(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray]) -> float:
    """The largest per-tensor ||got - want|| / ||want|| over the floating-point tensors."""
    return max(float(np.linalg.norm(got[k] - w) / max(np.linalg.norm(w), 1e-12)) for k, w in want.items()
               if w.dtype.kind == "f")


def check(soak: Soak, reference: Path, out: Optional[str], rounding: float = 0.0) -> List[str]:
    """Every check on a finished soak; returns the failures (empty: passed)."""
    from elasticflow.data.order import permutation

    run, problems = soak.run, []
    if out is None:
        return [f"the job did not end after the soak (pid {soak.proc.pid})"]
    if soak.proc.returncode != 0:
        return [f"the job exited {soak.proc.returncode}: {out.strip()[-1500:]}"]
    if soak.reproducible:  # every tensor and every step's loss ==, not near
        got, want = final_params(run), final_params(reference)
        unequal = sorted(k for k in want if k not in got or not np.array_equal(got[k], want[k]))
        losses = {r["step"]: r["loss"] for r in steps_logged(reference)}
        off = [r["step"] for r in steps_logged(run) if losses.get(r["step"]) != r["loss"]]
        print(f"tensors not bitwise the 1-worker run's: {len(unequal)} of {len(want)}; steps whose loss is not: "
              f"{len(off)}")
        if unequal or off:
            problems.append(f"not the 1-worker run's bits: tensors {unequal[:5]}, losses of steps {off[:5]}")
    diff = relative_difference(final_params(run), final_params(reference))
    # ``rounding``: what float32 rounding alone does to the same 1-worker run (1 thread against 2); a run that
    # amplifies it (diloco's outer momentum, over hundreds of rounds) is held to 3 times that, not to RTOL.
    bound = max(RTOL, 3 * rounding)
    print(f"max relative difference to the 1-worker parameters: {diff:.2e}"
          + (f" (rounding alone: {rounding:.2e}; bound {bound:.2e})" if rounding else ""))
    if not diff <= bound:
        problems.append(f"final parameters differ from the 1-worker run's by {diff:.2e} > {bound:.2g}"
                        f"{first_divergence(reference, run)}")

    # The data cursor: steps 1..N logged once each, at the epoch and samples_seen of the fixed global order.
    ref_steps = steps_logged(reference)
    n_samples = max(r["samples_seen"] for r in ref_steps if r["epoch"] == 0)
    batch, per_epoch = 64, -(-n_samples // 64)
    steps = steps_logged(run)
    if [r["step"] for r in steps] != list(range(1, soak.steps + 1)):
        problems.append("metrics.jsonl does not log steps 1..N exactly once each")
    seen, committed = 0, {}
    for r in steps:
        epoch, pos = divmod(r["step"] - 1, per_epoch)
        seen += min(batch, n_samples - pos * batch)
        if (r["epoch"], r["samples_seen"]) != (epoch, seen):
            problems.append(f"step {r['step']}: cursor at epoch {r['epoch']}, samples_seen {r['samples_seen']}; "
                            f"expected {epoch}, {seen}")
            break
        committed[r["step"]] = (r["generation"], epoch, pos * batch)
    # The samples: what the committing generation's workers fetched is the step's slice of the permutation.
    # With diloco, a replica's part of a step counts from the generation that trained the replica whose move
    # the round used (the round events' trained_in): a survivor keeps what it trained before a failure.
    events = list(jsonl(run / "events.jsonl"))
    trained = {(k, i): g for e in events if e["event"] == "round" for k in range(e["first_step"], e["last_step"] + 1)
               for i, g in enumerate(e["trained_in"])}
    fetched: Dict[int, list] = {k: [] for k in committed}
    for f in (run / "samples").glob("*.jsonl"):
        for r in jsonl(f):
            g, epoch = committed.get(r["step"], (None, None))[:2]
            if r.get("replica", -1) >= 0:
                g = trained.get((r["step"], r["replica"]))
            if (g, epoch) == (r["generation"], r["epoch"]):
                fetched[r["step"]] += r["ids"]
    orders: Dict[int, np.ndarray] = {}
    wrong = []
    for k, (g, epoch, start) in committed.items():
        order = orders.setdefault(epoch, permutation(n_samples, 0, epoch))
        if sorted(fetched[k]) != sorted(order[start:start + batch].tolist()):
            wrong.append(k)
    if wrong:
        problems.append(f"{len(wrong)} step(s) did not use their slice of the sample order exactly once "
                        f"(first: step {wrong[0]})")
    epochs = Counter(e for _, e, _ in committed.values())
    print(f"samples: {len(committed)} steps over {len(epochs)} epoch(s) checked, {len(wrong)} wrong")
    # With diloco the workers begin from the same parameters only at a round's first step (then each replica
    # moves on its own).
    firsts = {e["first_step"] for e in events if e["event"] == "round"}
    starts, split = replica_starts(run, {k: g for k, (g, _, _) in committed.items() if not firsts or k in firsts})
    if split:
        k = split[0]
        problems.append(f"{len(split)} step(s) began with members holding different parameters (first: step {k} "
                        f"in generation {committed[k][0]}, checksums by worker {starts[k]})")
    print(f"replicas: {len(starts)} steps checked, {len(split)} begun from different parameters")

    # Membership: every generation formed or was superseded within its timeouts; no innocent cut out.
    events = jsonl(run / "events.jsonl")
    bound = 2 * TIMEOUT_S + FORM_SLACK_S
    published = [e["generation"] for e in events if e["event"] == "generation"]
    ended = {e["generation"]: e for e in events if e["event"] in ("formed", "superseded")}
    # A generation is done forming when it formed, was superseded, or lost a member (then the agent waits,
    # up to elastic.wait_s, for enough workers to publish the next one: a wait for workers, not formation).
    slow = []
    for e in events:
        if e["event"] != "generation" or e["generation"] not in ended:
            continue
        done = min([ended[e["generation"]]["time"]] + [x["time"] for x in events if x["event"] in ("left", "hung")
                                                       and x["worker"] in e["members"] and x["time"] >= e["time"]])
        if done - e["time"] > bound:
            slow.append((e["generation"], round(done - e["time"], 1), ended[e["generation"]].get("cause", "formed")))
    if slow:
        problems.append(f"{len(slow)} generation(s) took longer than {bound:g}s to form or be superseded "
                        f"(generation, seconds, cause): {slow[:3]}")
    if published and published[-1] not in ended or ended.get(published[-1], {}).get("event") != "formed":
        problems.append(f"the last generation ({published[-1] if published else None}) never formed")
    hanging = [g for g in published[:-1] if g not in ended]
    if hanging:
        problems.append(f"generation(s) {hanging[:5]} neither formed nor were superseded")
    hung = {e["pid"] for e in events if e["event"] == "hung"}
    if hung - soak.ever_stopped:
        problems.append(f"worker(s) {sorted(hung - soak.ever_stopped)} were cut out as hung but never stopped")
    # Stopped past the heartbeat timeout: cut out -- unless it had already left (a retiree's exit 5).
    gone = {e["pid"] for e in events if e["event"] == "retired" and e.get("exit_code") == 5}
    missed = soak.doomed - hung - gone
    if missed:
        problems.append(f"worker(s) {sorted(missed)} stopped past elastic.heartbeat_timeout_s were never cut out")
    left = {e["pid"] for e in events if e["event"] == "left"}
    if left - soak.killed - hung:
        problems.append(f"worker(s) {sorted(left - soak.killed - hung)} left without being killed")
    kinds = Counter(e["event"] for e in events)
    formed = [e["formed_s"] for e in events if e["event"] == "formed"]
    print(f"membership: {len(published)} generations published, {kinds['formed']} formed (slowest "
          f"{max(formed or [0]):.2f}s), {kinds['superseded']} superseded, {kinds['joined']} joins, "
          f"{kinds['recovered']} recoveries, {kinds['hung']} cut out as hung, {kinds['left']} left")
    if soak.scale_results["traceback"]:
        problems.append("an `elasticflow scale` command crashed with a traceback")
    if "topology=hierarchical" in soak.topology:
        leaders = Counter(len(e["groups"]) for e in events if e["event"] == "groups")
        print(f"hierarchy: {sum(leaders.values())} generations summed through their groups' leaders "
              f"(by number of groups: {dict(sorted(leaders.items()))})")
        if not leaders:
            problems.append("topology=hierarchical, yet no generation formed groups")
    if "topology=parameter_server" in soak.topology:
        roles = [e for e in events if e["event"] == "roles"]
        took_over = sum(1 for a, b in zip(roles, roles[1:]) if b["primaries"] != a["primaries"])
        killed = Counter(e.get("as") for e in soak.log if e["kind"] == "kill")
        print(f"roles: {len(roles)} generations dealt, the primary changed {took_over} time(s), "
              f"{sum(e['moved'] for e in roles)} elements of shard moved; kills by role: {dict(killed)}")
        if [e for e in events if e["event"] == "fell_back"]:
            problems.append("a shard was lost: the job fell back to a checkpoint")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, help="seconds of faults (default 75)")
    ap.add_argument("--events", type=int, default=0,
                    help="fire this many events instead of --duration's seconds, every family (kill, short stop, "
                         "long stop, scale) among them: a slow machine then delays the faults, it never skips one")
    ap.add_argument("--seed", type=int, default=1, help="replays the same choices (default 1)")
    ap.add_argument("--step-sleep", type=float, default=0.1, help="seconds per forward while the soak runs")
    ap.add_argument("--keep", type=Path, help="keep the run directories here (must not exist)")
    ap.add_argument("--topology", default="ring", choices=["ring", "hierarchical", "diloco", "parameter_server"],
                    help="the job's topology (hierarchical: groups of 2 workers, topology.group_size=2; diloco: 4 "
                         "replicas, rounds of 4 steps; parameter_server: one shard, topology.replica=2)")
    ap.add_argument("--reproducible", action="store_true",
                    help="train with trainer.reproducible=true (micro-batches of 16) and require the 1-worker run's "
                         "bits: every tensor and every step's loss ==")
    ap.add_argument("--min-events", type=int, default=0,
                    help="go on past --duration until this many events fired (at most 2x the duration)")
    args = ap.parse_args()
    if args.events and (args.duration is not None or args.min_events):
        print("error: --events counts the faults; --duration and --min-events time them: pass one or the other\n"
              "hint: e.g. scripts/soak/chaos.py --events 8 --seed 1", file=sys.stderr)
        return 2
    if args.events and args.events < len(FAMILIES):
        print(f"error: --events must be at least {len(FAMILIES)} (one of each family: "
              f"{', '.join(FAMILIES)}), got {args.events}\nhint: e.g. --events 8", file=sys.stderr)
        return 2
    if args.duration is None:
        args.duration = 75.0
    if not args.duration > 0 or not args.step_sleep > 0:
        print(f"error: --duration and --step-sleep must be positive seconds, got {args.duration:g} and "
              f"{args.step_sleep:g}\nhint: e.g. scripts/soak/chaos.py --duration 75 --seed 1", file=sys.stderr)
        return 2
    if args.min_events < 0:
        print(f"error: --min-events must be 0 or more, got {args.min_events}\nhint: e.g. --min-events 20 (0: "
              "the faults end with --duration)", file=sys.stderr)
        return 2
    if args.reproducible and args.topology not in ("ring", "hierarchical"):
        print(f"error: --reproducible with --topology {args.topology}: the mode runs on ring and hierarchical only\n"
              "hint: drop --topology or pass --topology hierarchical", file=sys.stderr)
        return 2
    if args.keep is not None and args.keep.exists():
        print(f"error: --keep {args.keep} already exists\nhint: name a new directory (the soak writes two runs "
              "there)", file=sys.stderr)
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="chaos-"))
    soak = Soak(root / "run", args.duration, args.step_sleep, args.seed, args.min_events, args.topology,
                args.reproducible, args.events)
    faults = f"{args.events} events" if args.events else f"{args.duration:g}s of faults"
    print(f"chaos soak: {faults}, seed {args.seed}, {soak.steps} steps, topology {args.topology}, "
          f"run {soak.run}", flush=True)
    began = time.monotonic()
    try:
        ref = root / "reference"
        plain = {k: v for k, v in soak.env.items() if not k.startswith("EF_PROBE_")}
        # The 1-worker run: one process (with diloco, training every replica in turn).
        same = soak.topology if args.topology == "diloco" else []
        subprocess.run(CLI + ["train", str(PROBE), f"hydra.run.dir={ref}", *common(soak.steps), *same, *soak.mode],
                       env=plain,
                       check=True, capture_output=True, timeout=900)
        rounding = 0.0
        if same:  # diloco: what rounding alone does to the reference, the same run on 1 thread (threads=null: 2)
            subprocess.run(CLI + ["train", str(PROBE), f"hydra.run.dir={root / 'rounding'}", *common(soak.steps),
                                  *same, "backend.threads=1"], env=plain, check=True, capture_output=True, timeout=900)
            rounding = relative_difference(final_params(root / "rounding"), final_params(ref))
        soak.start()
        soak.drive()
        out = soak.settle(timeout=300 + soak.steps * 0.05)
        problems = check(soak, ref, out, rounding)
    finally:
        soak.reap()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    counts = Counter(e["kind"] for e in soak.log)
    print(f"events: {len(soak.log)} ({', '.join(f'{k} {n}' for k, n in sorted(counts.items()))}; "
          f"{sum(e['chained'] for e in soak.log)} chained)")
    print(f"scale commands: {dict(sorted(soak.scale_results.items()))}")
    print(f"outcome: {'PASS' if not problems else 'FAIL'} in {time.monotonic() - began:.0f}s")
    for p in problems:
        print(f"  - {p}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())

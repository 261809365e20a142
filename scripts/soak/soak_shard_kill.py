"""Sharded-state kill soak (issue #30): SIGKILL a worker of a ``trainer.shard=optimizer`` job inside each
phase of a step, at random steps, and check that every run ends on the 1-worker run's model.

    .venv/bin/python scripts/soak/soak_shard_kill.py                 # 20 single kills + 3 double kills, ~5 min
    .venv/bin/python scripts/soak/soak_shard_kill.py --runs 5 --pairs 1 --seed 7

The job: ``elasticflow train tests/models/shard_probe.py`` (digits MLP, Adam lr 0.003, global batch 64,
60 steps, every step logged), ``trainer.shard=optimizer``, no interval checkpoints: a slice lost with both
its holders is the run's error, never a quiet fall back. The kills (the probe's EF_SHARD_KILL) rotate
through the phases of a step, each at a random step and victim:
  reduction  in the gradient's sum: the victim sends its gradient to one random peer only (or to nobody)
             and dies; that peer commits the step, the others stay one step behind (the reported bug)
  update     in the sharded update, one of its two ranges updated
  exchange   in the parameters' allgather: its range reaches one random peer only
Single kills: 3 workers. Double kills (``--pairs``): 4 workers, ranks 0 and 2 or 1 and 3 (not neighbours:
each one's buddy lives) in the same phase of the same step, each sending to a random survivor.

Checks per run: exit 0; no ``fell_back`` event; steps 1..60 logged once each; the sample ids each step's
committing generation fetched (the probe's records) are every sample of each epoch once; final parameters
and optimizer state within 1e-5 relative (per tensor) of the 1-worker run with replicated state
(tests/test_shard.py's criterion). Prints one line per run and the count; exit 1 if any run failed.
Seeded: ``--seed`` replays the same steps, phases, victims and peers.

``--stage parameters`` (issue #46): the same soak for ``trainer.shard=parameters`` (ZeRO 3) on
tests/models/units_probe.py (four submodules, each a unit; 512 wide, SGD with momentum, micro-batches of 8), its
EF_UNITS_KILL rotating through that stage's phases: a unit's fetch in forward, its fetch in backward, a unit's
gradient on its way to its owners (each at a random call of the step), and the update between its two ranges.

    .venv/bin/python scripts/soak/soak_shard_kill.py --stage parameters --runs 20 --pairs 4
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from elasticflow._util.fileio import read_jsonl as jsonl  # noqa: E402  (skips the line a SIGKILLed writer tore)

CLI = [sys.executable, "-m", "elasticflow.cli"]
STEPS, RTOL = 60, 1e-5
COMMON = ["trainer.global_batch_size=64", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
          "trainer.progress=false", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5", "elastic.wait_s=30"]
# By stage: the probe model, its overrides, its kill variable, the phases a kill rotates through, and how many
# calls of the phase in the step the victim may die at (random in 1..n).
STAGES = {
    "optimizer": (REPO / "tests" / "models" / "shard_probe.py", ["optimizer=adam", "optimizer.lr=0.003"],
                  "EF_SHARD_KILL", {"reduction": 1, "update": 1, "exchange": 1}),
    "parameters": (REPO / "tests" / "models" / "units_probe.py",
                   ["trainer.micro_batch_size=8", "+model_args.hidden=512", "optimizer.momentum=0.9",
                    "optimizer.lr=0.02"],
                   "EF_UNITS_KILL", {"forward_fetch": 8, "backward_fetch": 8, "reduce": 8, "update": 1}),
}
STAGE = "optimizer"


def train(run: Path, workers: int, kills: str = "", timeout: float = 240) -> Tuple[int, str]:
    """One job; returns (exit code, its output's tail)."""
    probe, extra, variable, _ = STAGES[STAGE]
    shard = f"trainer.shard={STAGE}" if workers > 1 else "trainer.shard=none"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", variable: kills, "EF_PROBE_RECORD": str(run / "samples"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    (run / "samples").mkdir(parents=True)
    cmd = CLI + ["train", str(probe), f"hydra.run.dir={run}", *COMMON, *extra, f"launcher.workers={workers}", shard]
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout:.0f} s: {str(exc.stdout or '')[-400:]}"
    return proc.returncode, (proc.stdout + proc.stderr)[-2000:]


def final_state(run: Path) -> Dict[str, np.ndarray]:
    import elasticflow.checkpoint as ckpt

    state = ckpt.load(ckpt.latest(run / "checkpoints"))
    return {k: np.asarray(v, np.float64) for k, v in state.items() if not k.startswith("rng/")}


def samples_once(run: Path) -> Optional[str]:
    """None if each step's committing generation fetched every sample of its epoch once; else what not."""
    steps = [r for r in jsonl(run / "metrics.jsonl") if "loss" in r]
    committed = {r["step"]: r["generation"] for r in steps}
    per_step: Dict[int, List[int]] = {}
    for f in (run / "samples").glob("*.jsonl"):
        for r in jsonl(f):
            if committed.get(r["step"]) == r["generation"]:
                per_step.setdefault(r["step"], []).extend(r["ids"])
    epochs: Dict[int, Counter] = {}
    for r in steps:
        ids = per_step.get(r["step"], [])
        if len(ids) != r["global_batch"]:
            return f"step {r['step']}: {len(ids)} samples fetched, batch {r['global_batch']}"
        epochs.setdefault(r["epoch"], Counter()).update(ids)
    twice = {e: [i for i, c in counts.items() if c > 1][:3] for e, counts in epochs.items()}
    twice = {e: ids for e, ids in twice.items() if ids}
    return f"samples used twice: {twice}" if twice else None


def check(run: Path, rc: int, out: str, reference: Dict[str, np.ndarray]) -> Tuple[bool, str]:
    """(passed, what happened)."""
    if rc != 0:
        lines = [ln for ln in out.splitlines() if ln.startswith("error")] or out.splitlines()[-1:]
        return False, f"exit {rc}: {lines[-1][:300] if lines else ''}"
    events = list(jsonl(run / "events.jsonl"))
    if any(e["event"] == "fell_back" for e in events):
        return False, "fell back to a checkpoint"
    steps = [r["step"] for r in jsonl(run / "metrics.jsonl") if "loss" in r]
    if steps != list(range(1, STEPS + 1)):
        return False, f"steps logged {Counter(steps).most_common(2)} (want 1..{STEPS} once each)"
    wrong = samples_once(run)
    if wrong:
        return False, wrong
    got = final_state(run)
    worst = 0.0
    for name, want in reference.items():
        rel = float(np.linalg.norm(got[name] - want) / max(np.linalg.norm(want), 1e-12))
        if rel > RTOL:
            return False, f"{name}: relative difference {rel:.3g} > {RTOL:g}"
        worst = max(worst, rel)
    rec = [e for e in events if e["event"] == "recovered"]
    how = "; ".join(f"recovered at world {e['world_size']}" + (" (rolled forward)" if e["rolled_forward"] else "")
                    for e in rec) or "no recovery"
    return True, f"ok: {how}, max rel diff {worst:.1e}"


def describe(kills: List[Tuple[int, int, str, Optional[int]]]) -> str:
    out = []
    for rank, step, phase, peer in kills:
        if STAGE == "parameters":
            to = f" (call {peer})" if phase != "update" else ""
        else:
            to = "" if phase == "update" else f" (to rank {peer} only)" if peer is not None else " (to nobody)"
        out.append(f"rank {rank} in {phase}{to}")
    return f"step {kills[0][1]:2d}: " + ", ".join(out)


def plan(rng: random.Random, runs: int, pairs: int) -> List[Tuple[int, List[Tuple[int, int, str, Optional[int]]]]]:
    """[(workers, [(rank, step, phase, peer)])]: the single kills, then the double ones; phases rotate. For
    stage 3, ``peer`` is the call of the phase the victim dies at (the update's second: between its ranges)."""
    phases = STAGES[STAGE][3]
    names = list(phases)

    def peer_of(phase: str, others: List[int]) -> Optional[int]:
        if STAGE == "parameters":
            return 2 if phase == "update" else rng.randint(1, phases[phase])
        return None if phase == "update" else rng.choice(others + ([None] if phase == "reduction" else []))

    out = []
    for i in range(runs):
        phase, rank, step = names[i % len(names)], rng.randrange(3), rng.randint(2, STEPS - 2)
        out.append((3, [(rank, step, phase, peer_of(phase, [r for r in range(3) if r != rank]))]))
    for i in range(pairs):
        phase, step = names[i % len(names)], rng.randint(2, STEPS - 2)
        victims = rng.choice([(0, 2), (1, 3)])
        survivors = [r for r in range(4) if r not in victims]
        out.append((4, [(v, step, phase, peer_of(phase, survivors)) for v in victims]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="single kills (3 workers)")
    ap.add_argument("--pairs", type=int, default=3, help="two non-neighbouring kills at once (4 workers)")
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--keep", action="store_true", help="keep the run folders (printed at the end)")
    ap.add_argument("--stage", choices=sorted(STAGES), default="optimizer", help="the trainer.shard stage soaked")
    args = ap.parse_args()
    global STAGE
    STAGE = args.stage
    root = Path(tempfile.mkdtemp(prefix="soak_shard_kill_"))
    started = time.time()
    try:
        rc, out = train(root / "reference", 1)
        if rc != 0:
            print(f"the 1-worker reference run failed (exit {rc}):\n{out}")
            return 1
        reference = final_state(root / "reference")
        results = {3: [], 4: []}
        todo = plan(random.Random(args.seed), args.runs, args.pairs)
        for i, (workers, kills) in enumerate(todo, 1):
            run = root / f"run{i:02d}"
            spec = ",".join(f"{r}:{s}:{p}" + ("" if peer is None else f":{peer}") for r, s, p, peer in kills)
            t0 = time.time()
            rc, out = train(run, workers, spec)
            ok, what = check(run, rc, out, reference)
            results[workers].append(ok)
            print(f"run {i:2d}/{len(todo)}  {workers} workers  {describe(kills):60s} {time.time() - t0:5.1f} s  "
                  f"{'' if ok else 'FAILED: '}{what}", flush=True)
        single, double = results[3], results[4]
        print(f"{sum(single)}/{len(single)} finished with the 1-worker parameters (one kill each, 3 workers)")
        if double:
            print(f"{sum(double)}/{len(double)} finished with the 1-worker parameters (two non-neighbouring kills, "
                  f"4 workers)")
        print(f"seed {args.seed}, {time.time() - started:.0f} s" + (f", runs kept in {root}" if args.keep else ""))
        return 0 if all(single + double) else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

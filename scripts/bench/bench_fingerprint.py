"""The price of the replicas' fingerprints (``elastic.fingerprint``, train/fingerprint.py; issue 66: <= 2% of a
step on the wide-MLP and GPT-style benchmarks).

Each model of scripts/bench/bench_exact.py (the same settings, the default reduction) trains with 2 workers twice
per round, ``elastic.fingerprint=false`` (the baseline) and ``true``, the order flipping every round. Printed per
model: each arm's median step time (``step_time_s`` after ``--warmup`` steps, the median over rounds) and their
ratio, which on a shared machine is as noisy as a step; and the fingerprint's own cost, timed here on the run's
final state (what a member computes every step: the parameters' checksum and a quarter of each optimizer slot's,
the median over 48 steps) as a share of the baseline's step.

    .venv/bin/python scripts/bench/bench_fingerprint.py               # ~3 min on 2 cores
    .venv/bin/python scripts/bench/bench_fingerprint.py --models mlp --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_exact import MODELS, REPO, command, records  # noqa: E402

sys.path.insert(0, str(REPO))
import elasticflow.checkpoint as ckpt  # noqa: E402
from elasticflow.train.fingerprint import Fingerprints  # noqa: E402


def arm(model: str, on: bool, steps: int, warmup: int, out: Path) -> float:
    cmd = command(model, 2, False, steps, 1, out) + [f"elastic.fingerprint={str(on).lower()}"]
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"error: {model} (fingerprint={on}) exited {done.returncode}: see {out}/train.log")
    return statistics.median(r["step_time_s"] for r in records(out) if "loss" in r and r["step"] > warmup)


class _Final:
    """An engine's view of a run's final checkpoint, as fingerprint.Fingerprints reads one: the parameters as one
    flat float32 tensor and each optimizer slot (AdamW's two moments) as another, in the same order."""

    def __init__(self, state: dict):
        import torch

        names = [n for n, v in state.items() if not n.startswith(("optimizer/", "rng/")) and v.dtype.kind == "f"
                 and any(k.startswith(f"optimizer/{n}/") for k in state)]
        slots = sorted({k.rsplit("/", 1)[1] for k in state if k.startswith("optimizer/")})
        flat = lambda keys: torch.cat([torch.from_numpy(state[k].astype("float32").ravel()) for k in keys])
        self.params = flat(names)
        self.slots = {s: flat([f"optimizer/{n}/{s}" for n in names]) for s in slots
                      if all(f"optimizer/{n}/{s}" in state for n in names)}

    def flat_params(self):
        return self.params

    def flat_slots(self):
        return self.slots


def checksum_s(out: Path) -> tuple:
    """What a member computes every step (Fingerprints.slots: the parameters' checksum and a quarter of each
    optimizer slot's), on the run's final state: (parameters, slots' elements, median seconds over 48 steps)."""
    engine = _Final(ckpt.load(ckpt.latest(out / "checkpoints")))
    fp = Fingerprints(engine, None)
    times = []
    for step in range(48):
        started = time.perf_counter()
        fp.slots(step)
        times.append(time.perf_counter() - started)
    return engine.params.numel(), sum(v.numel() for v in engine.slots.values()), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt", "mlp"], choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_fingerprint_") as tmp:
        for model in args.models:
            got = {False: [], True: []}
            for r in range(args.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    got[on].append(arm(model, on, args.steps, args.warmup, Path(tmp) / f"{model}-{r}-{on}"))
            off, on = statistics.median(got[False]), statistics.median(got[True])
            n, slots, own = checksum_s(Path(tmp) / f"{model}-0-True")
            print(f"{model}: step {off * 1e3:.1f} ms without, {on * 1e3:.1f} ms with fingerprints ({on / off:.3f}x); "
                  f"the checksums of {n / 1e6:.2f}M parameters and a quarter of {slots / 1e6:.2f}M optimizer slot "
                  f"elements {own * 1e3:.2f} ms = {own / off * 100:.2f}% of a step", flush=True)


if __name__ == "__main__":
    main()

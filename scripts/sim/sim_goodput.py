"""Goodput at 1k, 16k and 100k GPUs under four fault-tolerance policies, from measured per-failure costs and
published failure rates. A first-order model (below), not a trace replay: it says where each policy loses its
time, and how that grows with the job's failure rate.

    .venv/bin/python scripts/sim/sim_goodput.py --goodput docs/benchmarks/elastic-costs-goodput.json

The job: N GPUs in replica groups of ``--group`` GPUs (a node), a step of ``--step-s`` seconds, failures as a
Poisson process with the mean time to failure (MTTF) of a job of that size, a fraction ``--silent`` of them
silent (a host that stops answering without closing its sockets: power, a hung kernel, a partition).
Per failure, every policy first loses its detection time on every GPU (a silent failure is seen only by a
timeout), then:

  restart (torchrun)      the whole job restarts (``--restart-s``) and redoes the work since its last
                          checkpoint (half a checkpoint interval on average); each checkpoint blocks the job
                          ``--ckpt-s``; the interval is Young/Daly's optimum sqrt(2 x ckpt x MTTF)
  restart, in-memory      the same with DLRover's flash checkpoint: a blocking copy to host memory
  (DLRover flash)         (``--flash-ckpt-s``) and a restart in place (``--flash-restart-s``)
  torchft                 the survivors go on at once; the step in flight is discarded (half a step lost on
                          every GPU, and its samples are never trained on); the failed group is missing until a
                          spare joins (``--replace-s``), a capacity loss of group/N for that long
  ElasticFlow             as torchft, but the step in flight is redone with the same global batch (the same
                          half step lost, no sample dropped), and the detection and regroup costs are
                          ElasticFlow's measured ones: a killed worker's (the ledger: detection + rebuild +
                          transfer per recovery) or a silent host's (``--ef-silent-s``, scripts/bench/bench_hosts.py)

Goodput = 1 - (lost GPU-seconds per second of wall time), per GPU: 1 - C/tau - (loss per failure) / MTTF for
the restart policies, 1 - (loss per failure) / MTTF for the others. Clipped at 0 (a policy whose recovery
outlasts the MTTF makes no progress). Exit 0; 2 for bad arguments or an unusable --goodput (one line).

Sources of the rates (printed with the table):
  1,024 and 16,384 GPUs: MTTF 7.9 h and 1.8 h, Meta's research clusters (Kokolis et al., "Revisiting
    Reliability in Large-Scale Machine Learning Research Clusters", 2024, arXiv:2410.21680).
  16,384 GPUs, Llama 3 405B pre-training: 466 job interruptions in 54 days, MTTF 2.8 h (Llama Team, "The Llama
    3 Herd of Models", 2024, arXiv:2407.21783, section 3.3.4): shown as a row of its own.
  100,000 GPUs: the 16k rate per GPU (1.8 h x 16,384) scaled to 100k: an extrapolation, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_trace import InputError, read_costs  # noqa: E402

HOUR = 3600.0
SCALES: List[Tuple[str, int, float]] = [  # (label, GPUs, MTTF in hours)
    ("1k (Kokolis et al.)", 1024, 7.9),
    ("16k (Kokolis et al.)", 16384, 1.8),
    ("16k (Llama 3)", 16384, 54 * 24 / 466),
    ("100k (extrapolated)", 100_000, 1.8 * 16384 / 100_000),
]
# The assumed inputs (flag, default, what it is): each policy's costs but ElasticFlow's measured ones.
ASSUMED = [
    ("--step-s", 10.0, "seconds per training step"),
    ("--silent", 0.5, "fraction of failures that are silent"),
    ("--loud-detect-s", 5.0, "a crash seen by the others, s"),
    ("--nccl-timeout-s", 600.0, "torch's default NCCL process-group timeout, s"),
    ("--torchft-timeout-s", 60.0, "torchft Manager's timeout, s"),
    ("--restart-s", 600.0, "a whole job's relaunch, rendezvous and checkpoint load, s"),
    ("--ckpt-s", 60.0, "a blocking checkpoint to storage, s"),
    ("--flash-restart-s", 120.0, "DLRover's restart in place, s"),
    ("--flash-ckpt-s", 1.0, "a flash checkpoint's blocking copy, s"),
    ("--replace-s", 600.0, "a spare node ready to join, s"),
    ("--ef-silent-s", 10.17, "ElasticFlow, a cut host to the survivors' next step (measured: bench_hosts.py "
                             "--parts cut), s"),
]
POLICIES = ("restart (torchrun)", "restart, in-memory (DLRover flash)", "torchft", "ElasticFlow")


@dataclass
class Assumptions:
    """The inputs that are not measured here, each a flag of its own (defaults: see ``main``'s help)."""
    step_s: float
    group: int
    silent: float
    loud_detect_s: float       # torchrun / DLRover / torchft: a crashed process's error reaches its peers
    nccl_timeout_s: float      # torchrun / DLRover: a silent peer is seen when the collective times out
    torchft_timeout_s: float   # torchft's Manager(timeout=...) default: its collectives' timeout
    restart_s: float
    ckpt_s: float
    flash_restart_s: float
    flash_ckpt_s: float
    replace_s: float
    ef_silent_s: float         # measured: a cut host -> the survivors' next step (docs/benchmarks.md)


@dataclass
class Measured:
    """ElasticFlow's per-event costs from a run's goodput ledger (``sim_trace.read_costs``)."""
    failure_s: float  # detection + rebuild + transfer per recovery (the redone step is the model's own)
    join_s: float
    source: str


def detection(a: Assumptions, policy: str, measured: Measured) -> float:
    """Seconds every GPU waits between a failure and the policy's reaction, averaged over loud and silent."""
    if policy == "ElasticFlow":
        loud, silent = measured.failure_s, a.ef_silent_s
    elif policy == "torchft":
        loud, silent = a.loud_detect_s, a.torchft_timeout_s
    else:
        loud, silent = a.loud_detect_s, a.nccl_timeout_s
    return (1 - a.silent) * loud + a.silent * silent


def goodput(policy: str, gpus: int, mttf_s: float, a: Assumptions, measured: Measured) -> Tuple[float, Dict]:
    """(goodput, where the time goes: seconds lost per failure by part, and the checkpoint share)."""
    parts: Dict[str, float] = {"detection": detection(a, policy, measured)}
    overhead = 0.0
    if policy.startswith("restart"):
        ckpt, restart = (a.flash_ckpt_s, a.flash_restart_s) if "flash" in policy else (a.ckpt_s, a.restart_s)
        interval = math.sqrt(2 * ckpt * mttf_s)  # Young/Daly
        parts.update(restart=restart, rework=interval / 2)
        overhead = ckpt / interval
    else:
        parts["step in flight"] = a.step_s / 2
        parts["capacity"] = a.replace_s * min(1.0, a.group / gpus)
        if policy == "ElasticFlow":
            parts["join"] = measured.join_s
    lost = sum(parts.values())
    return max(0.0, 1.0 - overhead - lost / mttf_s), {"per_failure_s": parts, "checkpoint_share": overhead}


def table(a: Assumptions, measured: Measured) -> List[str]:
    width = max(map(len, POLICIES))
    lines = [f"{'GPUs (source of the MTTF)':24s} {'MTTF':>7s}  " + "  ".join(f"{p:>{len(p)}s}" for p in POLICIES)]
    for label, gpus, mttf_h in SCALES:
        cells = [f"{goodput(p, gpus, mttf_h * HOUR, a, measured)[0]:>{len(p)}.1%}" for p in POLICIES]
        lines.append(f"{label:24s} {mttf_h:6.2f}h  " + "  ".join(cells))
    lines.append("")
    lines.append("seconds lost per failure at 16k (Kokolis et al.), by part:")
    for p in POLICIES:
        g, why = goodput(p, 16384, 1.8 * HOUR, a, measured)
        parts = ", ".join(f"{k} {v:.1f}" for k, v in why["per_failure_s"].items())
        extra = f"; checkpoints take {why['checkpoint_share']:.1%} of the time" if why["checkpoint_share"] else ""
        lines.append(f"  {p:{width}s} {parts}{extra}")
    lines.append("Time only: torchft also never trains on the samples of each failure's step in flight (and its "
                 "batch shrinks by a group until the spare joins); ElasticFlow redoes that step with them.")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--goodput", type=Path, required=True, help="an ElasticFlow run's goodput.json (its costs)")
    ap.add_argument("--group", type=int, default=8, help="GPUs lost with one failure: a node (default 8)")
    for flag, default, what in ASSUMED:
        ap.add_argument(flag, type=float, default=default, help=f"{what} (default {default:g})")
    args = ap.parse_args(argv)
    numbers = {k: v for k, v in vars(args).items() if k != "goodput"}
    bad = [k for k, v in numbers.items() if not (math.isfinite(v) and v >= 0)] + \
        (["silent"] if not 0 <= args.silent <= 1 else []) + (["group"] if args.group < 1 else [])
    if bad:
        print(f"error: --{bad[0].replace('_', '-')} must be a finite number >= 0 (--silent in [0, 1], "
              f"--group >= 1), got {numbers[bad[0]]}\nhint: e.g. scripts/sim/sim_goodput.py --goodput "
              "docs/benchmarks/elastic-costs-goodput.json --silent 0.5", file=sys.stderr)
        return 2
    try:
        costs = read_costs(args.goodput)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seconds = json.loads(args.goodput.read_text())["seconds"]  # read_costs has checked the ledger
    recoveries = max(1, int(json.loads(args.goodput.read_text())["recoveries"]))
    measured = Measured(sum(float(seconds[k]) for k in ("detection", "rebuild", "transfer")) / recoveries,
                        costs.join, costs.source)
    a = Assumptions(**{k: v for k, v in numbers.items()})
    print(f"goodput by policy; ElasticFlow's costs from {measured.source}")
    print(f"assumed: a step {a.step_s:g} s, {a.group} GPUs lost per failure, {a.silent:.0%} of failures silent, "
          f"spare ready in {a.replace_s:g} s (flags: --help)")
    print("\n".join(table(a, measured)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gang against elastic scheduling on a simulated cluster, each membership change charged what ElasticFlow measured.

    .venv/bin/python scripts/sim/sim_scheduler.py --goodput docs/benchmarks/elastic-costs-goodput.json \\
        --jobs 1000 --load 0.9 --cluster 64 --seed 0 --plot docs/elastic-scheduling.png

Replays a trace of jobs (arrival, workers, run time at that size; scripts/sim/sim_trace.py) on a cluster of
``--cluster`` workers (GPUs) under three policies:

  gang FIFO      a job waits until all its workers are free; strict first-come first-served
  gang backfill  the same with EASY backfill: a later job may start ahead of a blocked head if it fits now
                 and does not delay the head's reserved start (run times known exactly: the best case)
  elastic        a job in [min_workers, workers] starts as soon as its minimum fits (on as many free workers
                 as it can use), taking workers from running jobs above their minimum (the most above it
                 first) if it must; freed workers grow the running jobs back towards their maximum, oldest
                 first. First-come first-served.

A change of a running job's size (all the workers added or taken at one decision are one change) stops its
progress for the measured cost of a join or a scale-down (``--goodput``) while it keeps its workers: they
are busy and not productive. Progress integrates the throughput (``sim_trace.rate``) while not stalled; a
job ends when its work (run time x throughput at the requested size) is done. Starting and ending a job
cost the same under every policy and are not modelled. Invariants checked after every run (``check``):
never more workers than the cluster, every job finishes, each job's work conserved. Deterministic for a seed.
Exit 0; 2 for bad arguments or an unusable --goodput or --trace file (one line on stderr).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_trace import (MEDIAN_S, SIGMA, SIZES, Costs, InputError, Job, describe, rate, read_costs,  # noqa: E402
                       read_csv, synthetic)

POLICIES = ("gang-fifo", "gang-backfill", "elastic")
LABELS = {"gang-fifo": "gang FIFO", "gang-backfill": "gang backfill", "elastic": "elastic"}


class InvariantError(AssertionError):
    """The simulation broke one of its own invariants: a bug in the simulator, never in the trace."""


@dataclass
class Record:
    """One job's run under one policy: its sizes over time and the change costs charged to it."""
    job: Job
    start: float = math.nan
    end: float = math.nan
    alloc: List[Tuple[float, int]] = field(default_factory=list)      # (time, workers from then on); last is 0
    charges: List[Tuple[float, float]] = field(default_factory=list)  # (time, seconds stalled) per change
    joins: int = 0
    downs: int = 0


@dataclass
class _Running:
    rec: Record
    n: int
    work: float             # to do, in one worker's seconds
    done: float = 0.0
    stall_until: float = 0.0
    stalled_s: float = 0.0  # seconds of stall served: must come to the charges' sum


class Sim:
    """One policy over one trace; ``run()`` returns each job's ``Record``."""

    def __init__(self, trace: Sequence[Job], cluster: int, policy: str, costs: Costs, efficiency: float = 1.0):
        self.trace, self.cluster, self.policy = sorted(trace, key=lambda j: (j.arrival, j.id)), cluster, policy
        self.costs, self.efficiency = costs, efficiency
        self.pending: List[Job] = []
        self.running: List[_Running] = []
        self.records: Dict[int, Record] = {j.id: Record(j) for j in self.trace}

    def free(self) -> int:
        return self.cluster - sum(r.n for r in self.running)

    def finish_time(self, r: _Running, t: float) -> float:
        return max(t, r.stall_until) + (r.work - r.done) / rate(r.n, self.efficiency)

    def run(self) -> List[Record]:
        t, arrivals = 0.0, list(self.trace)
        while arrivals or self.pending or self.running:
            ends = [self.finish_time(r, t) for r in self.running]
            t_next = min([arrivals[0].arrival if arrivals else math.inf] + ends)
            if math.isinf(t_next):
                raise InvariantError(f"stuck at t={t:.1f}: {len(self.pending)} pending, nothing running")
            for r in self.running:
                self._advance(r, t, t_next)
            t = t_next
            tol = 1e-9 * max(1.0, t)
            for r in [r for r in self.running if self.finish_time(r, t) <= t + tol]:
                self.running.remove(r)
                r.rec.end = t
                r.rec.alloc.append((t, 0))
                if abs(r.done - r.work) > 1e-6 * r.work or abs(r.stalled_s - sum(c for _, c in r.rec.charges)) > tol:
                    raise InvariantError(f"job {r.rec.job.id}: did {r.done} of {r.work}, stalled {r.stalled_s} s")
            while arrivals and arrivals[0].arrival <= t:
                self.pending.append(arrivals.pop(0))
            getattr(self, "_" + self.policy.replace("-", "_"))(t)
            if self.free() < 0:
                raise InvariantError(f"t={t:.1f}: {self.cluster - self.free()} workers busy of {self.cluster}")
        return [self.records[j.id] for j in self.trace]

    def _advance(self, r: _Running, t0: float, t1: float) -> None:
        productive_from = min(t1, max(t0, r.stall_until))
        r.stalled_s += productive_from - t0
        r.done += rate(r.n, self.efficiency) * (t1 - productive_from)

    def _start(self, job: Job, n: int, t: float) -> None:
        rec = self.records[job.id]
        rec.start = t
        rec.alloc.append((t, n))
        self.running.append(_Running(rec, n, job.duration * rate(job.workers, self.efficiency), stall_until=t))
        self.pending.remove(job)

    def _resize(self, r: _Running, n: int, t: float) -> None:
        grow = n > r.n
        cost = self.costs.join if grow else self.costs.scale_down
        r.rec.joins, r.rec.downs = r.rec.joins + grow, r.rec.downs + (not grow)
        r.stall_until = max(r.stall_until, t) + cost  # a change during a stall waits for it: costs add up
        r.rec.charges.append((t, cost))
        r.rec.alloc.append((t, n))
        r.n = n

    # ------------------------------------------------------------------ the policies, at each arrival and end
    def _gang_fifo(self, t: float) -> None:
        while self.pending and self.pending[0].workers <= self.free():
            self._start(self.pending[0], self.pending[0].workers, t)

    def _gang_backfill(self, t: float) -> None:
        """EASY backfill: the head's start is reserved at the earliest time enough workers will be free (the
        shadow); a later job jumps the queue if it fits now and ends by then or uses only workers the head
        will not need at the shadow."""
        self._gang_fifo(t)
        if not self.pending:
            return
        head, free = self.pending[0], self.free()
        avail, shadow, extra = free, math.inf, 0
        for end, n in sorted((self.finish_time(r, t), r.n) for r in self.running):
            avail += n
            if avail >= head.workers:
                shadow, extra = end, avail - head.workers
                break
        for job in list(self.pending[1:]):
            if job.workers > free:
                continue
            if t + job.duration <= shadow + 1e-9 * max(1.0, shadow):
                self._start(job, job.workers, t)
            elif job.workers <= extra:
                extra -= job.workers
                self._start(job, job.workers, t)
            else:
                continue
            free -= job.workers

    def _elastic(self, t: float) -> None:
        """Admit in arrival order while each minimum fits, shrinking running jobs towards their minimum where
        needed (the most workers above it first; ties: the latest started); then grow the running jobs,
        oldest first. Sizes are planned first and applied once, so a job changes at most once per decision."""
        size = {id(r): r.n for r in self.running}
        free, starts = self.free(), []
        while self.pending[len(starts):]:
            job = self.pending[len(starts)]
            if job.min_workers <= free:
                starts.append((job, min(job.workers, free)))
                free -= starts[-1][1]
                continue
            surplus = sum(size[id(r)] - r.rec.job.min_workers for r in self.running)
            if free + surplus < job.min_workers:
                break  # first come, first served: the head waits, and so does everyone behind it
            need = job.min_workers - free
            richest = lambda r: (r.rec.job.min_workers - size[id(r)], -r.rec.start, -r.rec.job.id)  # noqa: E731
            for r in sorted(self.running, key=richest):
                give = min(need, size[id(r)] - r.rec.job.min_workers)
                size[id(r)] -= give
                need -= give
                if need == 0:
                    break
            starts.append((job, job.min_workers))
            free = 0
        for r in sorted(self.running, key=lambda r: (r.rec.job.arrival, r.rec.job.id)):
            add = min(free, r.rec.job.workers - size[id(r)])
            size[id(r)] += add
            free -= add
        for r in list(self.running):
            if size[id(r)] != r.n:
                self._resize(r, size[id(r)], t)
        for job, n in starts:
            self._start(job, n, t)


def replay(rec: Record, efficiency: float, until: float = math.inf) -> Tuple[float, float, float]:
    """From a record alone: (work done, busy worker-seconds, of them stalled by changes), up to ``until``."""
    charges, stall_until, done, busy, lost = list(rec.charges), rec.start, 0.0, 0.0, 0.0
    for (a, n), (b, _) in zip(rec.alloc, rec.alloc[1:]):
        a, b = min(a, until), min(b, until)
        while charges and charges[0][0] <= a:
            stall_until = max(stall_until, charges[0][0]) + charges.pop(0)[1]
        productive_from = min(b, max(a, stall_until))
        done += rate(n, efficiency) * (b - productive_from)
        busy += n * (b - a)
        lost += n * (productive_from - a)
    return done, busy, lost


def check(records: Sequence[Record], cluster: int, policy: str, efficiency: float = 1.0) -> None:
    """The invariants, from the records alone: every job ran after it arrived and finished; sizes within
    [min_workers, workers] (gang: exactly workers); never more workers busy than the cluster; each job's work
    conserved; first-come first-served starts where the policy promises them. Raises ``InvariantError``."""
    for rec in records:
        job = rec.job
        if not (job.arrival <= rec.start < rec.end < math.inf) or rec.alloc[-1] != (rec.end, 0):
            raise InvariantError(f"{policy}: job {job.id} did not run to its end: {rec}")
        sizes = [n for _, n in rec.alloc[:-1]]
        low = job.workers if policy.startswith("gang") else job.min_workers
        if not all(low <= n <= job.workers for n in sizes):
            raise InvariantError(f"{policy}: job {job.id} ran on {sizes} workers, outside [{low}, {job.workers}]")
        done, _, _ = replay(rec, efficiency)
        want = job.duration * rate(job.workers, efficiency)
        if abs(done - want) > 1e-6 * want:
            raise InvariantError(f"{policy}: job {job.id} did {done:.6g} of its {want:.6g} worker-seconds of work")
        if policy.startswith("gang") and abs(rec.end - rec.start - job.duration) > 1e-6 * job.duration:
            raise InvariantError(f"{policy}: job {job.id} ran {rec.end - rec.start} s, not its {job.duration} s")
    times, busy = busy_over_time(records)
    if max(busy) > cluster:
        t = times[busy.index(max(busy))]
        raise InvariantError(f"{policy}: {max(busy)} workers busy at t={t:.1f} on a {cluster}-worker cluster")
    if policy != "gang-backfill":
        starts = [r.start for r in sorted(records, key=lambda r: (r.job.arrival, r.job.id))]
        if any(b < a for a, b in zip(starts, starts[1:])):
            raise InvariantError(f"{policy}: a job started before one that arrived earlier")


def simulate(trace: Sequence[Job], cluster: int, policy: str, costs: Costs, efficiency: float = 1.0) -> List[Record]:
    records = Sim(trace, cluster, policy, costs, efficiency).run()
    check(records, cluster, policy, efficiency)
    return records


# ---------------------------------------------------------------------- the report
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def summary(records: Sequence[Record], cluster: int, efficiency: float = 1.0) -> Dict[str, float]:
    pending = [r.start - r.job.arrival for r in records]
    jct = [r.end - r.job.arrival for r in records]
    makespan, last_arrival = max(r.end for r in records), max(r.job.arrival for r in records)
    parts = [replay(r, efficiency) for r in records]
    busy, lost = sum(p[1] for p in parts), sum(p[2] for p in parts)
    busy_arriving = sum(replay(r, efficiency, until=last_arrival)[1] for r in records)
    return {"pending_mean": sum(pending) / len(pending), "pending_p50": percentile(pending, 50),
            "pending_p95": percentile(pending, 95), "jct_mean": sum(jct) / len(jct), "jct_p50": percentile(jct, 50),
            "jct_p95": percentile(jct, 95), "makespan": makespan,
            "util_arriving": busy_arriving / (cluster * last_arrival) if last_arrival > 0 else math.nan,
            "util": busy / (cluster * makespan), "productive": (busy - lost) / busy,
            "joins": sum(r.joins for r in records), "downs": sum(r.downs for r in records),
            "lost_ws": lost}


def duration(s: float) -> str:
    if math.isnan(s):
        return "-"
    return f"{s:.1f} s" if s < 100 else f"{s / 60:.1f} min" if s < 6000 else f"{s / 3600:.2f} h"


ROWS = [("pending time, mean", "pending_mean", duration), ("pending time, p50", "pending_p50", duration),
        ("pending time, p95", "pending_p95", duration), ("completion time (JCT), mean", "jct_mean", duration),
        ("JCT, p50", "jct_p50", duration), ("JCT, p95", "jct_p95", duration), ("makespan", "makespan", duration),
        ("utilisation until the last arrival", "util_arriving", lambda x: f"{x:.1%}"),
        ("utilisation over the makespan", "util", lambda x: f"{x:.1%}"),
        ("productive share of busy time", "productive", lambda x: f"{x:.4%}"),
        ("membership changes: joins", "joins", lambda x: f"{x:d}"),
        ("membership changes: scale-downs", "downs", lambda x: f"{x:d}"),
        ("worker-seconds lost to changes", "lost_ws", lambda x: f"{x:.1f}")]


def table(results: Dict[str, Dict[str, float]]) -> str:
    lines = ["| | " + " | ".join(LABELS[p] for p in results) + " |", "|---" * (len(results) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(fmt(results[p][key]) for p in results) + " |" for name, key, fmt in ROWS]
    for gang in (p for p in results if p.startswith("gang")):
        e, g = results["elastic"], results[gang]
        ratio = lambda k: f"{e[k] / g[k]:.3f}" if g[k] > 0 else "-"  # noqa: E731
        lines.append(f"\nelastic / {LABELS[gang]}: pending time mean {ratio('pending_mean')}, p95 "
                     f"{ratio('pending_p95')}; JCT mean {ratio('jct_mean')}, p95 {ratio('jct_p95')}")
    return "\n".join(lines)


def busy_over_time(records: Sequence[Record]) -> Tuple[List[float], List[int]]:
    """The number of busy workers as a step function: (times, workers from each time on). At one instant the
    releases (negative) come first: a worker freed at t may be taken at t."""
    deltas = sorted((t, n - prev) for r in records for (t, n), prev in zip(r.alloc, [0] + [n for _, n in r.alloc]))
    times, busy = [0.0], [0]
    for t, d in deltas:
        times.append(t)
        busy.append(busy[-1] + d)
    return times, busy


def binned(times: List[float], busy: List[int], width: float, end: float) -> List[float]:
    """The mean of a step function over each bin of ``width`` seconds from 0 to ``end``."""
    sums = [0.0] * max(1, math.ceil(end / width))
    for (a, n), b in zip(zip(times, busy), times[1:] + [end]):
        while a < b and n:
            i = min(int(a // width), len(sums) - 1)
            upto = min(b, (i + 1) * width) if i < len(sums) - 1 else b
            sums[i] += n * (upto - a)
            a = upto
    return [s / width for s in sums]


def plot(path: Path, runs: Dict[str, List[Record]], cluster: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    end = max(r.end for records in runs.values() for r in records)
    width = max(3600.0, 3600.0 * round(end / 3600 / 60))  # about 60 bins, whole hours
    for policy, records in runs.items():
        for ax, values in ((axes[0], [r.start - r.job.arrival for r in records]),
                           (axes[1], [r.end - r.job.arrival for r in records])):
            xs = sorted(v / 3600 for v in values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=LABELS[policy])
        means = binned(*busy_over_time(records), width, end)
        axes[2].step([i * width / 3600 for i in range(len(means) + 1)], [m / cluster for m in means] + [0],
                     where="post", label=LABELS[policy], linewidth=1)
    axes[0].set_xscale("symlog", linthresh=0.01)
    axes[0].set(xlabel="pending time (h; symlog axis, 0 at the left)", ylabel="fraction of jobs",
                title="pending time, CDF")
    axes[1].set(xscale="log", xlabel="job completion time (h)", title="JCT, CDF")
    axes[2].set(xlabel="time (h)", ylabel="busy share of the cluster", ylim=(0, 1.02),
                title=f"utilisation of {cluster} workers, mean per {width / 3600:g} h")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="lower center" if ax is axes[2] else "lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def repeat(a: argparse.Namespace, costs: Costs) -> str:
    """The ratios elastic / gang for ``a.repeat`` synthetic traces from seed ``a.seed`` on: a row each, then medians."""
    rows, ratios = [], []
    for seed in range(a.seed, a.seed + a.repeat):
        trace, _ = synthetic(a.jobs, a.load, a.cluster, seed, a.min_share)
        got = {p: summary(simulate(trace, a.cluster, p, costs, a.efficiency), a.cluster, a.efficiency)
               for p in POLICIES}
        e = got["elastic"]
        ratios.append([e[k] / got[g][k] if got[g][k] > 0 else math.nan
                       for g in ("gang-fifo", "gang-backfill") for k in ("pending_mean", "jct_mean")])
        load = sum(j.workers * j.duration for j in trace) / (a.cluster * max(j.arrival for j in trace))
        rows.append(f"| {seed} | {load:.2f} | " + " | ".join(f"{x:.3f}" for x in ratios[-1]) + " |")
    medians = [percentile([r[i] for r in ratios if not math.isnan(r[i])] or [math.nan], 50) for i in range(4)]
    return "\n".join(["| seed | realised load | pending, elastic / gang FIFO | JCT, elastic / gang FIFO | "
                      "pending, elastic / gang backfill | JCT, elastic / gang backfill |", "|---" * 6 + "|", *rows,
                      "| median | | " + " | ".join(f"{x:.3f}" for x in medians) + " |"])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--goodput", type=Path, required=True, help="a run's goodput.json: the per-change costs")
    p.add_argument("--events", type=Path, help="that run's events.jsonl (default: found beside --goodput)")
    p.add_argument("--trace", type=Path, help="a CSV trace (arrival_s,workers,duration_s[,min_workers]) "
                   "instead of the synthetic one")
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--load", type=float, default=0.9, help="offered load, a share of the cluster's capacity")
    p.add_argument("--cluster", type=int, default=64, help="workers (GPUs) in the cluster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-share", type=float, default=0.5, help="elastic minimum = ceil(share x workers), >= 1")
    p.add_argument("--efficiency", type=float, default=1.0, help="per-worker throughput kept per doubling "
                   "of workers (1: linear)")
    p.add_argument("--cost-scale", type=float, default=1.0, help="multiply the measured change costs")
    p.add_argument("--repeat", type=int, default=1, help="also the ratios (means) for this many synthetic "
                   "traces, seeds --seed, --seed + 1, ...")
    p.add_argument("--plot", type=Path, help="write the CDFs and busy workers over time to this PNG")
    a = p.parse_args(argv)
    if min(a.jobs, a.cluster, a.repeat) < 1 or a.load <= 0 or not 0 < a.min_share <= 1 or not 0 < a.efficiency <= 1 \
            or a.cost_scale < 0:
        p.error("need --jobs, --cluster, --repeat >= 1, --load > 0, 0 < --min-share <= 1, 0 < --efficiency <= 1, "
                "--cost-scale >= 0")
    try:
        costs = read_costs(a.goodput, a.events, a.cost_scale)
        if a.trace:
            trace, made = read_csv(a.trace, a.cluster, a.min_share), f"{a.trace}"
        else:
            trace, per_s = synthetic(a.jobs, a.load, a.cluster, a.seed, a.min_share)
            sizes = {s: p for s, p in SIZES.items() if s <= a.cluster}
            made = (f"synthetic, seed {a.seed}: Poisson arrivals at {per_s * 3600:.3f}/h (offered load {a.load:g} of "
                    f"{a.cluster} workers), workers {sizes}{' (renormalised)' if len(sizes) < len(SIZES) else ''}, "
                    f"min_workers ceil({a.min_share:g} x workers), run time log-normal (median "
                    f"{MEDIAN_S / 3600:g} h, sigma {SIGMA:g})")
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"costs per membership change: join {costs.join:.4f} s, scale-down {costs.scale_down:.4f} s"
          f"{f' (x{a.cost_scale:g})' if a.cost_scale != 1 else ''}; a failure {costs.failure:.4f} s (not simulated)")
    print(f"  from {costs.source}")
    print(f"trace: {made}; {describe(trace, a.cluster)}")
    print(f"throughput: {'linear in workers' if a.efficiency == 1 else f'{a.efficiency:g} per doubling'} "
          f"(--efficiency {a.efficiency:g})\n")
    runs = {policy: simulate(trace, a.cluster, policy, costs, a.efficiency) for policy in POLICIES}
    print(table({policy: summary(records, a.cluster, a.efficiency) for policy, records in runs.items()}))
    if a.plot:
        plot(a.plot, runs, a.cluster)
        print(f"plot: {a.plot}")
    if a.repeat > 1 and not a.trace:
        print(f"\nmean pending time and JCT, elastic / gang, {a.repeat} traces:\n" + repeat(a, costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

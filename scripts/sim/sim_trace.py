"""The inputs of sim_scheduler.py, beside it: the trace of jobs, the costs of a membership change, the throughput model.

A trace is a list of ``Job`` (arrival, requested workers, the elastic minimum, the run time at the requested
size), either synthetic (``synthetic``: Poisson arrivals, power-of-two sizes, log-normal durations, a fixed
seed) or read from a CSV (``read_csv``). The costs come from a real run's goodput ledger (``read_costs``):
its seconds by cause divided by the number of changes of each kind in the run's events.jsonl.
"""
from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# Sizes in workers (GPUs) and their probabilities: a stated assumption, not a published trace's figures.
SIZES: Dict[int, float] = {1: 0.40, 2: 0.20, 4: 0.15, 8: 0.12, 16: 0.08, 32: 0.05}
MEDIAN_S = 3600.0   # the log-normal's median run time at the requested size: exp(mu)
SIGMA = 1.5         # its sigma: mean = median * exp(sigma^2 / 2) = 3.08 h, p99 = median * exp(2.326 sigma) = 33 h


class InputError(Exception):
    """A trace or a goodput file that cannot be used: one line for the user."""


@dataclass(frozen=True)
class Job:
    """One job: ``workers`` is the gang size and the elastic maximum; ``duration`` its run time at ``workers``."""
    id: int
    arrival: float
    workers: int
    min_workers: int
    duration: float


@dataclass(frozen=True)
class Costs:
    """Seconds a job's workers all lose per membership change (``failure``: detection + rebuild + redone +
    transfer, reported but not simulated), and what they were derived from."""
    join: float
    scale_down: float
    failure: float
    source: str


def rate(workers: int, efficiency: float = 1.0) -> float:
    """Throughput at ``workers`` in units of one worker's: linear at efficiency 1; each doubling of the
    workers keeps ``efficiency`` of the per-worker rate (0.9: 2 workers 1.8, 4 workers 3.24)."""
    return workers * efficiency ** math.log2(workers) if workers > 0 else 0.0


def min_for(workers: int, min_share: float) -> int:
    return max(1, min(workers, math.ceil(workers * min_share)))


def synthetic(jobs: int, load: float, cluster: int, seed: int, min_share: float = 0.5,
              sizes: Optional[Dict[int, float]] = None) -> Tuple[List[Job], float]:
    """``jobs`` jobs with Poisson arrivals at the rate that offers ``load`` of ``cluster`` workers' capacity.

    Offered load = rate x E[workers] x E[duration] / cluster, with the distributions' own means (not the
    sample's). Sizes larger than the cluster are left out of ``sizes`` (renormalised). Returns the trace and
    the arrival rate per second.
    """
    sizes = {s: p for s, p in (sizes or SIZES).items() if s <= cluster}
    total = sum(sizes.values())
    mean_size = sum(s * p for s, p in sizes.items()) / total
    mean_duration = MEDIAN_S * math.exp(SIGMA ** 2 / 2)
    per_s = load * cluster / (mean_size * mean_duration)
    rng = random.Random(seed)
    population, weights = list(sizes), [p / total for p in sizes.values()]
    t, trace = 0.0, []
    for i in range(jobs):
        t += rng.expovariate(per_s)
        workers = rng.choices(population, weights)[0]
        duration = rng.lognormvariate(math.log(MEDIAN_S), SIGMA)
        trace.append(Job(i, t, workers, min_for(workers, min_share), duration))
    return trace, per_s


def read_csv(path: Path, cluster: int, min_share: float) -> List[Job]:
    """A trace from a CSV with columns arrival_s, workers, duration_s and optionally min_workers."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        trace = []
        for i, row in enumerate(rows):
            workers = int(row["workers"])
            low = int(row["min_workers"]) if row.get("min_workers") else min_for(workers, min_share)
            job = Job(i, float(row["arrival_s"]), workers, low, float(row["duration_s"]))
            if not (1 <= job.min_workers <= job.workers <= cluster and job.duration > 0 and job.arrival >= 0):
                raise ValueError(f"row {i + 2}: needs 1 <= min_workers <= workers <= cluster ({cluster}), "
                                 f"duration_s > 0, arrival_s >= 0; got {row}")
            trace.append(job)
    except (OSError, KeyError, ValueError) as exc:
        raise InputError(f"--trace {path}: {exc}; expected a CSV with columns arrival_s,workers,duration_s"
                         "[,min_workers]") from None
    if not trace:
        raise InputError(f"--trace {path}: no jobs in it")
    return sorted(trace, key=lambda j: (j.arrival, j.id))


def _events_beside(goodput: Path) -> Optional[Path]:
    """RUN_DIR/events.jsonl for RUN_DIR/goodput.json; NAME-events.jsonl for a copy named NAME-goodput.json."""
    for name in ("events.jsonl", goodput.name.replace("goodput.json", "events.jsonl")):
        candidate = goodput.with_name(name)
        if candidate != goodput and candidate.is_file():
            return candidate
    return None


def read_costs(goodput: Path, events: Optional[Path] = None, scale: float = 1.0) -> Costs:
    """Per-change costs from a run's goodput.json (and its events.jsonl, found beside it unless given).

    Join and scale-down: the ``regrouped`` events' seconds (the ledger's ``regroup``), split by whether the
    world grew or shrank, divided by the number of each; failure: the ledger's redone + detection + rebuild
    + transfer over its ``recoveries``. Without events, joins and scale-downs both get regroup / regroups.
    Raises ``InputError`` for a file that is not a ledger, or events that do not add up to it.
    """
    hint = "expected the goodput.json an ElasticFlow run writes (RUN_DIR/goodput.json) with membership changes"
    try:
        led = json.loads(Path(goodput).read_text())
        seconds = {k: float(led["seconds"][k]) for k in ("regroup", "redone", "detection", "rebuild", "transfer")}
        regroups, recoveries = int(led["regroups"]), int(led["recoveries"])
    except OSError as exc:
        raise InputError(f"--goodput {goodput}: {exc.strerror}; {hint}") from None
    except (ValueError, KeyError, TypeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0][:120]
        raise InputError(f"--goodput {goodput}: not a goodput ledger ({what}); {hint}") from None
    if regroups < 1:
        raise InputError(f"--goodput {goodput}: the run had no membership change (regroups 0); {hint}")
    failure_s = sum(seconds[k] for k in ("redone", "detection", "rebuild", "transfer"))
    failure = failure_s / recoveries if recoveries else float("nan")
    events = events or _events_beside(Path(goodput))
    if events is None:
        per = seconds["regroup"] / regroups
        return Costs(per * scale, per * scale, failure * scale,
                     f"{goodput}: regroup {seconds['regroup']:.3f} s / {regroups} regroups (joins and scale-downs "
                     f"not told apart: no events.jsonl beside it), failures {failure_s:.3f} s / {recoveries}")
    joins, downs, failed = _changes(events)
    if len(joins) + len(downs) != regroups or len(failed) != recoveries or \
            abs(sum(joins) + sum(downs) - seconds["regroup"]) > 0.01:
        raise InputError(f"--events {events}: {len(joins) + len(downs)} regroups ({sum(joins) + sum(downs):.3f} s) "
                         f"and {len(failed)} recoveries, but the ledger has {regroups} ({seconds['regroup']:.3f} s) "
                         f"and {recoveries}; pass the events.jsonl of the run that wrote {goodput}")
    told = f"{len(joins)} joins ({sum(joins):.3f} s) and {len(downs)} scale-downs ({sum(downs):.3f} s)"
    if joins and downs:
        join, down = sum(joins) / len(joins), sum(downs) / len(downs)
    else:  # one kind only: both from the ledger's mean
        join = down = seconds["regroup"] / regroups
        told += ", both charged their mean"
    return Costs(join * scale, down * scale, failure * scale,
                 f"{goodput} with {events}: regroup {seconds['regroup']:.3f} s over {told}; failures "
                 f"{failure_s:.3f} s over {recoveries} recoveries")


def _changes(events: Path) -> Tuple[List[float], List[float], List[float]]:
    """The seconds of each join and scale-down (``regrouped``: the world grew or shrank) and each recovery."""
    joins: List[float] = []
    downs: List[float] = []
    failed: List[float] = []
    try:
        lines = Path(events).read_text().splitlines()
    except OSError as exc:
        raise InputError(f"--events {events}: {exc.strerror}") from None
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:  # a line torn by a SIGKILLed writer, as elasticflow._util.fileio.read_jsonl skips it
            continue
        if e.get("event") == "regrouped":
            grew = int(e.get("world_size", 0)) > int(e.get("previous_world_size", 0))
            (joins if grew else downs).append(float(e.get("recovery_s") or 0.0))
        elif e.get("event") == "recovered":
            failed.append(float(e.get("recovery_s") or 0.0))
    return joins, downs, failed


def describe(trace: Sequence[Job], cluster: int) -> str:
    """The sample's own load: sum(workers x duration) / (cluster x the last arrival)."""
    work = sum(j.workers * j.duration for j in trace)
    span = max(j.arrival for j in trace)
    return f"{len(trace)} jobs over {span / 3600:.1f} h, realised load {work / (cluster * span):.2f}" if span > 0 \
        else f"{len(trace)} jobs"

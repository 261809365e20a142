"""`elasticflow plot RUN_DIR [-o FILE.png]`: a run at a glance, from its own records.

Five panels. Against the optimizer step: the loss (train, and eval where there is one) with the moments that
matter marked on it (the best checkpoint, the early stop, each worker lost or joined); the monitored metric
(``checkpoint.monitor``, else ``callbacks.early_stopping.monitor``, else eval_loss) with its best value starred;
the learning rate. Against wall time: throughput (samples/s: each logged step a dot, and a line of the samples
over the seconds of a window of steps) and the number of workers, which changes at the membership event itself
(a worker lost drops it when the agent saw it go, not seconds later when the survivors logged their first step),
with every membership event of events.jsonl a vertical line coloured by kind. metrics.jsonl and events.jsonl are
appended across requeues and resumes, so a run of several jobs is one continuous plot (the gaps between jobs show
as gaps).

Every marker line carries a ``gid`` naming what it marks (``mark:best``, ``mark:left``, ``event:joined``...):
the tests read it, and an SVG keeps it as the element's id.
"""
from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import ElasticFlowError
from .._util.fileio import read_jsonl
from .._util.untrusted import number, unix_time

# The events marked on the time panels, and their colours; others are not drawn.
MARKED = {"left": "tab:red", "hung": "tab:purple", "joined": "tab:green", "recovered": "tab:orange",
          "regrouped": "tab:olive", "retired": "tab:brown", "restart": "tab:pink", "preempt": "tab:cyan",
          "superseded": "tab:gray", "scale": "tab:blue", "straggler": "gold"}
# The moments marked on the loss panel (by step): what a reader of the loss curve asks "what happened here?" of.
ON_LOSS = {"best": ("gold", "-.", "best checkpoint"), "stopped_early": ("black", "-", "early stop"),
           "left": ("tab:red", "--", "worker lost"), "hung": ("tab:purple", "--", "worker hung"),
           "joined": ("tab:green", "--", "worker joined"), "straggler": ("goldenrod", ":", "straggler")}
# Events that say the world size they leave behind.
SIZED = ("ready", "joined", "recovered", "regrouped")
SMOOTH = 9  # the smoothed throughput's narrowest window, in logged steps (a 25th of them where that is more)


def figure(run_dir: Path):
    """The matplotlib Figure of ``run_dir``: five axes, titled loss, the monitored metric, learning rate,
    throughput and workers (in that order)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ElasticFlowError(f"{run_dir} is not a directory", "pass a run directory (hydra.run.dir of a train run)")
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if type(r.get("step")) is int]
    steps = [r for r in records if number(r.get("loss")) and unix_time(r.get("time"))]
    if not steps:
        raise ElasticFlowError(f"{run_dir} has no logged steps yet (metrics.jsonl is missing or empty)",
                               "plot a run that has trained at least trainer.log_every steps")
    events = read_jsonl(run_dir / "events.jsonl", timed=True)
    t0 = min([steps[0]["time"]] + [e["time"] for e in events])

    fig, axes = plt.subplots(5, 1, figsize=(10, 15), constrained_layout=True)
    fig.suptitle(str(run_dir))
    loss_ax, monitor_ax, lr_ax, speed_ax, world_ax = axes
    monitor, mode, source = _monitor(run_dir, records)
    best = _best(records, monitor, mode)
    _loss(loss_ax, steps, records, events, best, source)
    _monitored(monitor_ax, records, monitor, mode, best, source)
    _lr(lr_ax, steps)
    _throughput(speed_ax, steps, t0)
    _workers(world_ax, steps, events, t0)

    drawn = set()
    for e in events:
        kind = e.get("event", "event")
        if kind not in MARKED:
            continue
        for ax in (speed_ax, world_ax):
            ax.axvline(e["time"] - t0, color=MARKED[kind], linestyle="--", linewidth=1, gid=f"event:{kind}",
                       label=kind if ax is world_ax and kind not in drawn else None)
        drawn.add(kind)
    if drawn:
        world_ax.legend(loc="best", fontsize="small")
    return fig


def plot(run_dir: Path, out: Optional[Path] = None) -> Path:
    """Write the figure of ``run_dir`` to ``out`` (default RUN_DIR/run.png); returns the path."""
    out = Path(out) if out else Path(run_dir) / "run.png"
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ElasticFlowError(f"cannot write a plot to {out}: unknown format {out.suffix!r}",
                               "name the file .png, .svg or .pdf")
    figure(run_dir).savefig(out, dpi=110)
    return out


# ---------------------------------------------------------------------------------------------- panels
def _loss(ax, steps: List[dict], records: List[dict], events: List[dict], best, source: str) -> None:
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train")
    evals = [r for r in records if number(r.get("eval_loss"))]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    marks: List[Tuple[str, float, str]] = []
    if best is not None:
        marks.append(("best", best[0], f"{'best checkpoint' if source == 'checkpoint' else 'best'}: step {best[0]}"))
    times, numbers = [r["time"] for r in steps], [r["step"] for r in steps]
    for e in events:
        kind = e.get("event")
        if kind not in ON_LOSS:
            continue
        # The step it happened at: its own where it says one (early stop), else the last step logged before it.
        step = e["step"] if type(e.get("step")) is int else numbers[max(bisect.bisect_right(times, e["time"]) - 1, 0)]
        worker = f" {e['worker']}" if type(e.get("worker")) is int else ""
        text = {"left": f"worker{worker} lost", "hung": f"worker{worker} hung", "joined": f"worker{worker} joined",
                "straggler": f"worker{worker} straggler",
                "stopped_early": f"early stop: step {step}"}[kind]
        marks.append((kind, step, text))
    labelled = set()
    for kind, step, text in marks:
        color, style, name = ON_LOSS[kind]
        ax.axvline(step, color=color, linestyle=style, linewidth=2.5 if kind == "best" else 1,
                   zorder=3 if kind == "best" else 2,
                   gid=f"mark:{kind}", label=(text if kind in ("best", "stopped_early") else name)
                   if kind not in labelled else None)
        labelled.add(kind)
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.legend(loc="upper right", fontsize="small")


def _monitored(ax, records: List[dict], monitor: Optional[str], mode: str, best, source: str) -> None:
    values = [r for r in records if monitor and number(r.get(monitor))]
    if not values:
        ax.set(title="monitored metric", xlabel="step")
        ax.text(0.5, 0.5, f"no values of {monitor} in metrics.jsonl" if monitor else
                "no monitored metric: set checkpoint.monitor or callbacks.early_stopping.monitor "
                "(and trainer.eval_every)", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    ax.plot([r["step"] for r in values], [r[monitor] for r in values], "o-" if len(values) < 200 else "-",
            color="tab:orange", label=monitor)
    if best is not None:
        ax.plot([best[0]], [best[1]], "*", color="gold", markersize=16, markeredgecolor="black", gid="mark:best",
                label=f"best: {best[1]:.4g} at step {best[0]}")
    where = {"checkpoint": "checkpoint.monitor", "early_stopping": "callbacks.early_stopping.monitor"}.get(source)
    ax.set(xlabel="step", ylabel=monitor, title=f"{monitor} ({where}, {mode})" if where else monitor)
    ax.legend(loc="best", fontsize="small")


def _lr(ax, steps: List[dict]) -> None:
    groups = sorted({k for r in steps for k in r if k.startswith("lr_group") and number(r[k])})
    for key in ["lr"] + groups:
        have = [r for r in steps if number(r.get(key))]
        if have:
            ax.plot([r["step"] for r in have], [r[key] for r in have], label=key)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    if groups:
        ax.legend(loc="best", fontsize="small")


def _throughput(ax, steps: List[dict], t0: float) -> None:
    timed = [r for r in steps if number(r.get("step_time_s")) and number(r.get("global_batch", 0))]
    x = [r["time"] - t0 for r in timed]
    y = [r.get("global_batch", 0) / max(r["step_time_s"], 1e-9) for r in timed]
    ax.plot(x, y, ".", markersize=3, alpha=0.35, color="tab:blue", label="each logged step")
    if len(y) >= 3:
        window = min(max(SMOOTH, len(y) // 25) | 1, len(y))
        ax.plot(x, rolling_rate([r.get("global_batch", 0) for r in timed], [r["step_time_s"] for r in timed],
                                window), "-", color="tab:blue", linewidth=2, gid="smoothed",
                label=f"over {window} logged steps")
    ax.set(xlabel="time (s)", ylabel="samples/s", title="throughput")
    ax.legend(loc="lower right", fontsize="small")


def _workers(ax, steps: List[dict], events: List[dict], t0: float) -> None:
    times, sizes = workers_line(steps, events)
    ax.step([t - t0 for t in times], sizes, where="post", gid="workers")
    ax.set(xlabel="time (s)", ylabel="workers", title="workers", ylim=(0, max(sizes) + 0.5))
    ax.yaxis.get_major_locator().set_params(integer=True)


# ---------------------------------------------------------------------------------------------- series
def rolling_rate(samples: List[float], seconds: List[float], window: int) -> List[float]:
    """Samples per second over each logged step's centred window of ``window`` (narrower at the ends): the
    samples over the seconds, not a mean of per-step rates, which one fast step would pull up (on shared cores
    step times alternate between two paces, and a median jumped between them)."""
    import numpy as np

    half = window // 2
    n, s = np.cumsum([0.0, *samples]), np.cumsum([0.0, *seconds])
    out = []
    for i in range(len(samples)):
        lo, hi = max(0, i - half), min(len(samples), i + half + 1)
        out.append(float((n[hi] - n[lo]) / max(s[hi] - s[lo], 1e-9)))
    return out


def workers_line(steps: List[dict], events: List[dict]) -> Tuple[List[float], List[int]]:
    """(times, world sizes) of a step line of the workers: each logged step's ``world_size``, the size an event
    states (ready, joined, recovered, regrouped), and a lost or hung worker's drop at the event's own time: the
    survivors log their first step of the smaller world only after detection and recovery (seconds later)."""
    points = [(r["time"], int(r["world_size"]) if number(r.get("world_size")) else 1) for r in steps]
    points += [(e["time"], int(e["world_size"])) for e in events
               if e.get("event") in SIZED and number(e.get("world_size")) and e["world_size"] >= 1]
    points.sort(key=lambda p: p[0])
    times = [t for t, _ in points]
    for e in events:
        if e.get("event") not in ("left", "hung"):
            continue
        at = bisect.bisect_right(times, e["time"])
        if 0 < at < len(points) and points[at][1] < points[at - 1][1]:  # a member left: the world shrank
            points.insert(at, (e["time"], points[at][1]))
            times.insert(at, e["time"])
    return times, [n for _, n in points]


def _monitor(run_dir: Path, records: List[dict]) -> Tuple[Optional[str], str, str]:
    """(metric, mode, where it was named: "checkpoint", "early_stopping" or "") of the run: its config's
    checkpoint.monitor, else callbacks.early_stopping.monitor (RUN_DIR/.hydra/config.yaml), else eval_loss
    where the run evaluated."""
    config = _config(run_dir)
    for source, section in (("checkpoint", config.get("checkpoint")),
                            ("early_stopping", (config.get("callbacks") or {}).get("early_stopping"))):
        if isinstance(section, dict) and isinstance(section.get("monitor"), str) and section["monitor"]:
            return section["monitor"], "max" if section.get("mode") == "max" else "min", source
    if any(number(r.get("eval_loss")) for r in records):
        return "eval_loss", "min", ""
    return None, "min", ""


def _config(run_dir: Path) -> Dict[str, Any]:
    """RUN_DIR/.hydra/config.yaml as plain data ({} where it is missing, too big or not YAML: a plot without it
    still shows everything but the monitor's name)."""
    import yaml

    path = run_dir / ".hydra" / "config.yaml"
    try:
        if path.stat().st_size > 1 << 20:
            return {}
        found = yaml.safe_load(path.read_text(errors="replace"))
    except (OSError, yaml.YAMLError, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


def _best(records: List[dict], monitor: Optional[str], mode: str) -> Optional[Tuple[int, float]]:
    """(step, value) of the best ``monitor`` value, the first of equals (train/callbacks.py's BestCheckpoints
    ranks by value, then step)."""
    values = [(r[monitor] if mode == "min" else -r[monitor], r["step"]) for r in records
              if monitor and number(r.get(monitor))]
    if not values:
        return None
    value, step = min(values)
    return step, value if mode == "min" else -value

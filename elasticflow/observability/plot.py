"""`elasticflow plot RUN_DIR [-o FILE.png]`: a run at a glance, from its own records.

Three panels: the loss (train, and eval where there is one) against the optimizer step; throughput
(samples/s) against wall time; the number of workers against wall time. Every membership event of
events.jsonl (left, hung, joined, recovered, retired, preempted, requeued, ...) is a vertical line on
the time panels, coloured by kind. metrics.jsonl and events.jsonl are appended across requeues and
resumes, so a run of several jobs is one continuous plot (the gaps between jobs show as gaps).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import ElasticFlowError
from .._util.fileio import read_jsonl
from .._util.untrusted import number, unix_time

# The events marked, and their colours; others are drawn grey.
MARKED = {"left": "tab:red", "hung": "tab:purple", "joined": "tab:green", "recovered": "tab:orange",
          "regrouped": "tab:olive", "retired": "tab:brown", "restart": "tab:pink", "preempt": "tab:cyan",
          "superseded": "tab:gray", "scale": "tab:blue"}


def figure(run_dir: Path):
    """The matplotlib Figure of ``run_dir`` (three axes: loss, throughput, workers)."""
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
    evals = [r for r in records if number(r.get("eval_loss"))]
    events = read_jsonl(run_dir / "events.jsonl", timed=True)
    t0 = min([steps[0]["time"]] + [e["time"] for e in events])

    fig, (loss_ax, speed_ax, world_ax) = plt.subplots(3, 1, figsize=(10, 9), constrained_layout=True)
    fig.suptitle(str(run_dir))
    loss_ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train")
    if evals:
        loss_ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    loss_ax.legend()

    timed = [r for r in steps if number(r.get("step_time_s")) and number(r.get("global_batch", 0))]
    speed_ax.plot([r["time"] - t0 for r in timed],
                  [r.get("global_batch", 0) / max(r["step_time_s"], 1e-9) for r in timed], ".", markersize=3)
    speed_ax.set(xlabel="time (s)", ylabel="samples/s", title="throughput")
    world_ax.step([r["time"] - t0 for r in steps],
                  [r["world_size"] if number(r.get("world_size")) else 1 for r in steps], where="post")
    world_ax.set(xlabel="time (s)", ylabel="workers", title="workers")
    world_ax.yaxis.get_major_locator().set_params(integer=True)

    drawn = set()
    for e in events:
        kind = e.get("event", "event")
        if kind not in MARKED:
            continue
        for ax in (speed_ax, world_ax):
            # gid: the figure says which event each line is (tests read it; an SVG keeps it as an id)
            ax.axvline(e["time"] - t0, color=MARKED[kind], linestyle="--", linewidth=1, gid=f"event:{kind}",
                       label=kind if ax is world_ax and kind not in drawn else None)
        drawn.add(kind)
    if drawn:
        world_ax.legend(loc="best", fontsize="small")
    return fig


def plot(run_dir: Path, out: Optional[Path] = None) -> Path:
    """Write the figure of ``run_dir`` to ``out`` (default RUN_DIR/run.png); returns the path."""
    fig = figure(run_dir)
    out = Path(out) if out else Path(run_dir) / "run.png"
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ElasticFlowError(f"cannot write a plot to {out}: unknown format {out.suffix!r}",
                               "name the file .png, .svg or .pdf")
    fig.savefig(out, dpi=110)
    return out

"""`elasticflow plot`: the figure's axes and event markers (the matplotlib objects, not pixels)."""
import pytest

from harness import cli, events, finish, reap, run_cli, start, train, wait_for, world_sizes

pytest.importorskip("matplotlib")
from elasticflow.observability.plot import figure  # noqa: E402


def _joined_steps(run) -> int:
    """How many steps ran with the joiner: those of 3 workers after the first of 2."""
    sizes = world_sizes(run)
    return sizes[sizes.index(2):].count(3) if 2 in sizes else 0


@pytest.fixture(scope="module")
def killed_and_joined(tmp_path_factory):
    """3 workers, one killed at step 15, then `scale --workers 3` brings a joiner."""
    run = tmp_path_factory.mktemp("run")
    pace = run.parent / f"{run.name}.pace"  # slow steps until the joiner has trained a few steps; then full speed
    pace.touch()
    proc = start(run, "trainer.max_steps=300", "launcher.workers=3", "launcher.max_workers=3",
                 common=["trainer.progress=false", "trainer.log_every=1", "elastic.timeout_s=10",
                         "elastic.heartbeat_timeout_s=5"],
                 env={"EF_PROBE_KILL": "1:15:forward", "EF_PROBE_SLEEP": "0.05", "EF_PROBE_PACE": str(pace)})
    try:
        wait_for(lambda: events(run, "left"), 120, "the kill", proc=proc)
        run_cli(["scale", run, "--workers", "3"], timeout=150, check=True)
        wait_for(lambda: events(run, "joined"), 60, "the joiner", proc=proc)
        wait_for(lambda: _joined_steps(run) >= 3, 60, "a few steps with the joiner, for the throughput panel",
                 proc=proc)
        pace.unlink()
        out = finish(proc)
    finally:
        reap(proc)
    assert proc.returncode == 0, out[-3000:]
    return run


def _panels(fig) -> dict:
    """The figure's axes by title (the monitored metric's title names the metric: "monitored" here)."""
    titles = ["loss", "monitored", "learning rate", "throughput", "workers"]
    assert len(fig.axes) == 5
    return dict(zip(titles, fig.axes))


def _marks(ax, prefix: str) -> dict:
    """{gid: [x, ...]} of the marker lines of ``ax`` whose gid starts with ``prefix``."""
    out = {}
    for line in ax.get_lines():
        if (line.get_gid() or "").startswith(prefix):
            out.setdefault(line.get_gid(), []).append(line.get_xdata()[0])
    return out


def test_the_figure_has_loss_throughput_and_workers_with_the_kill_and_the_join(killed_and_joined):
    """Issue 68 item 7: the kill and the join marked on the loss curve, throughput smoothed, and the workers line
    stepping down at the `left` event itself, not when the survivors logged their first step of 2."""
    p = _panels(figure(killed_and_joined))
    loss, speed, world = p["loss"], p["throughput"], p["workers"]
    assert [p[k].get_title() for k in ("loss", "learning rate", "throughput", "workers")] == \
        ["loss", "learning rate", "throughput", "workers"]
    assert loss.get_xlabel() == "step" and speed.get_xlabel() == world.get_xlabel() == "time (s)"
    assert loss.get_lines()[0].get_label() == "train"  # the probe has no eval_data: no eval line
    assert list(loss.get_lines()[0].get_xdata()) == list(range(1, 301))
    kills, joins = _marks(loss, "mark:").get("mark:left"), _marks(loss, "mark:").get("mark:joined")
    assert kills and 10 <= kills[0] <= 15 and joins and kills[0] < joins[0] < 300  # by step: killed at 15
    assert p["monitored"].texts and "no monitored metric" in p["monitored"].texts[0].get_text()
    assert list(p["learning rate"].get_lines()[0].get_ydata()) == [0.1] * 300

    dots, smoothed = speed.get_lines()[0], next(li for li in speed.get_lines() if li.get_gid() == "smoothed")
    assert list(smoothed.get_xdata()) == list(dots.get_xdata()) and len(dots.get_xdata()) == 300
    assert min(smoothed.get_ydata()) >= min(dots.get_ydata()) and max(smoothed.get_ydata()) <= max(dots.get_ydata())

    markers = _marks(world, "event:")
    assert "event:left" in markers and "event:joined" in markers
    line = next(li for li in world.get_lines() if li.get_gid() == "workers")
    times, workers = list(line.get_xdata()), list(line.get_ydata())
    assert workers[0] == 3 and 2 in workers and workers[-1] == 3
    assert times[workers.index(2)] == markers["event:left"][0]  # the drop is at the event's time
    assert 0 < markers["event:left"][0] < max(times)


def test_a_requeued_run_is_one_plot_with_eval_and_the_preemption_marked(tmp_path):
    """Two jobs of one run (a requeue: metrics.jsonl and events.jsonl appended by both), written by hand, with
    checkpoint.monitor=eval_loss: its panel stars the best evaluation, which the loss panel marks with the early
    stop."""
    import json

    t, lines = 1000.0, []
    for step in range(1, 21):  # job 1: steps 1-20; preempted; job 2 resumes at step 21 a minute later
        t += 0.1 if step != 21 else 60.0
        lines.append({"step": step, "loss": 1.0 / step, "time": t, "step_time_s": 0.1, "global_batch": 64,
                      "world_size": 2, "samples_seen": 64 * step, "lr": 0.01 * step})
        if step in (10, 20):
            lines.append({"step": step, "epoch": 0, "eval_loss": 0.2 if step == 10 else 0.3, "eval_accuracy": 0.9})
    for step in range(21, 31):
        t += 60.0 if step == 21 else 0.1
        lines.append({"step": step, "loss": 1.0 / step, "time": t, "step_time_s": 0.1, "global_batch": 64,
                      "world_size": 4, "samples_seen": 64 * step, "lr": 0.2})
    lines.append({"step": 30, "epoch": 1, "eval_loss": 0.2, "eval_accuracy": 0.9})  # as good, not better
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"torn')
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "preempt", "time": 1002.05}) + "\n" + json.dumps(
        {"event": "stopped_early", "time": t, "step": 30, "reason": "eval_loss did not improve"}) + "\n")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("checkpoint:\n  monitor: eval_loss\n  mode: min\n")
    p = _panels(figure(tmp_path))
    loss, world = p["loss"], p["workers"]
    assert list(loss.get_lines()[0].get_xdata()) == list(range(1, 31))  # one line over both jobs
    assert list(loss.get_lines()[1].get_xdata()) == [10, 20, 30] and loss.get_lines()[1].get_label() == "eval"
    assert _marks(loss, "mark:") == {"mark:best": [10], "mark:stopped_early": [30]}
    assert p["monitored"].get_title() == "eval_loss (checkpoint.monitor, min)"
    star = next(li for li in p["monitored"].get_lines() if li.get_gid() == "mark:best")
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([10], [0.2])  # the first of equals, as ranked
    assert list(p["learning rate"].get_lines()[0].get_ydata())[-1] == 0.2
    assert list(next(li for li in world.get_lines() if li.get_gid() == "workers").get_ydata()) == [2] * 20 + [4] * 10
    assert list(_marks(world, "event:")) == ["event:preempt"]


def test_the_cli_writes_a_png(killed_and_joined, tmp_path):
    out = tmp_path / "run.png"
    proc = run_cli(["plot", killed_and_joined, "-o", out], timeout=120, check=True)
    assert f"wrote {out}" in proc.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line_with_a_hint(tmp_path):
    proc = cli(["plot", tmp_path / "nope"])
    assert proc.returncode == 2 and "error:" in proc.stderr and "is not a directory" in proc.stderr
    assert "hint:" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli(["plot", tmp_path])
    assert proc.returncode == 2 and "has no logged steps yet" in proc.stderr
    train("digits_mlp.py", tmp_path / "r", "trainer.max_steps=3")
    proc = cli(["plot", tmp_path / "r", "-o", tmp_path / "x.bmp"])
    assert proc.returncode == 2 and "unknown format '.bmp'" in proc.stderr


CRAFTED = ["[" * 100000, '{"event": "recovered"}', '{"time": 1e999, "event": "left"}', '{"time": "noon", "event": "x"}',
           '{"time": 1800000000.0, "event": 5}', '{"time": 1800000000.0, "event": "recovered", "recovery_s": "x"}',
           "not json", '"a string"']


def test_status_plot_and_the_ledger_skip_crafted_lines_of_events_jsonl(tmp_path, reference):
    """Lines of events.jsonl and metrics.jsonl that are no plausible record (a parser bomb, no time, a time past
    any clock, text where a figure belongs) once made `status` and `plot` fail with KeyError, OverflowError or
    RecursionError: they are skipped, and `status` says how many."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    with open(run / "events.jsonl", "a") as f:
        f.write("\n".join(CRAFTED) + "\n")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 61, "loss": "x", "time": 1800000000.0}\n{"step": 62, "loss": 1e999}\n' + "[" * 5000 + "\n")
    status = cli(["status", run])
    assert status.returncode == 0, status.stderr
    skipped = len(CRAFTED) - 1  # the one whose figure is text is a record of its own: the ledger skips it
    assert f"({skipped} unreadable lines of events.jsonl skipped)" in status.stdout, status.stdout
    assert "goodput" in status.stdout
    drawn = cli(["plot", run, "--output", tmp_path / "run.svg"])
    assert drawn.returncode == 0 and (tmp_path / "run.svg").stat().st_size > 0, drawn.stderr

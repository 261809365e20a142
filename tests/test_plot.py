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


def test_the_figure_has_loss_throughput_and_workers_with_the_kill_and_the_join(killed_and_joined):
    fig = figure(killed_and_joined)
    loss, speed, world = fig.axes[:3]
    assert [ax.get_title() for ax in (loss, speed, world)] == ["loss", "throughput", "workers"]
    assert loss.get_xlabel() == "step" and speed.get_xlabel() == world.get_xlabel() == "time (s)"
    assert [line.get_label() for line in loss.get_lines()] == ["train"]  # the probe has no eval_data
    assert list(loss.get_lines()[0].get_xdata()) == list(range(1, 301))
    markers = [line.get_gid() for line in world.get_lines() if (line.get_gid() or "").startswith("event:")]
    assert "event:left" in markers and "event:joined" in markers
    workers = list(world.get_lines()[0].get_ydata())
    assert workers[0] == 3 and 2 in workers and workers[-1] == 3
    left_at = next(line.get_xdata()[0] for line in world.get_lines() if line.get_gid() == "event:left")
    assert 0 < left_at < max(world.get_lines()[0].get_xdata())


def test_a_requeued_run_is_one_plot_with_eval_and_the_preemption_marked(tmp_path):
    """Two jobs of one run (a requeue: metrics.jsonl and events.jsonl appended by both), written by hand."""
    import json

    t, lines = 1000.0, []
    for step in range(1, 21):  # job 1: steps 1-20; preempted; job 2 resumes at step 21 a minute later
        t += 0.1 if step != 21 else 60.0
        lines.append({"step": step, "loss": 1.0 / step, "time": t, "step_time_s": 0.1, "global_batch": 64,
                      "world_size": 2, "samples_seen": 64 * step})
        if step == 10:
            lines.append({"step": 10, "epoch": 0, "eval_loss": 0.2, "eval_accuracy": 0.9})
    for step in range(21, 31):
        t += 60.0 if step == 21 else 0.1
        lines.append({"step": step, "loss": 1.0 / step, "time": t, "step_time_s": 0.1, "global_batch": 64,
                      "world_size": 4, "samples_seen": 64 * step})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"torn')
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "preempt", "time": 1002.05}) + "\n")
    fig = figure(tmp_path)
    loss, speed, world = fig.axes[:3]
    assert list(loss.get_lines()[0].get_xdata()) == list(range(1, 31))  # one line over both jobs
    assert list(loss.get_lines()[1].get_xdata()) == [10] and loss.get_lines()[1].get_label() == "eval"
    assert list(world.get_lines()[0].get_ydata()) == [2] * 20 + [4] * 10
    assert [line.get_gid() for line in world.get_lines()][1:] == ["event:preempt"]


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

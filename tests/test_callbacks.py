"""Callbacks (elasticflow/train/callbacks.py): early stopping, best-k checkpoints, the learning-rate monitor and a
model file's own callback, through kills, joins and resumes, as a Lightning user would use them.

The elastic runs stop where the 1-worker run stops and keep the checkpoints it keeps: the stop is agreed (an
every-rank callback decides from reduced values; a rank-0 callback's request is voted in the next step), and
the callbacks' state rides in checkpoints and in the state a joining worker receives.
"""
import json
import re
from pathlib import Path

import pytest

from elasticflow.train import callbacks as cb
from elasticflow.train.state import TrainState
from harness import (COMMON, Limit, assert_equivalent, events, finish, metrics, start, train_in_process, train_ok)

MODEL = Path(__file__).parent / "models" / "callback_probe.py"
# digits at lr 0.5, evaluated every 5 steps: eval_loss falls, wobbles, and stops improving by 0.003 near step 65
# (each improvement or setback is 1e-4 or more, far past what another number of workers moves: ~1e-6)
STOPPING = [c for c in COMMON if not c.startswith(("optimizer.lr", "trainer.max_steps"))] + [
    "optimizer.lr=0.5", "trainer.max_steps=200", "trainer.micro_batch_size=16", "trainer.eval_every=5",
    "callbacks.early_stopping.monitor=eval_loss", "callbacks.early_stopping.patience=2",
    "callbacks.early_stopping.min_delta=0.003",
    "checkpoint.monitor=eval_accuracy", "checkpoint.mode=max", "checkpoint.save_top_k=2", "checkpoint.keep=1"]


def _stopped(run: Path) -> dict:
    found = events(run, "stopped_early")
    assert len(found) == 1, f"expected one stopped_early event, got {found}"
    return found[0]


def _kept(run: Path) -> list:
    (job,) = (run / "checkpoints").iterdir()
    return sorted(p.name for p in job.iterdir() if p.name.startswith("step_"))


def _done(out: str) -> str:
    """The run's `done:` line (key=value fields; a stop's reason holds spaces and '=')."""
    return [line for line in out.splitlines() if line.startswith("done: ")][-1]


def test_early_stopping_and_best_k_end_a_killed_and_rejoined_run_as_one_worker(tmp_path, one_worker):
    """3 workers; worker 0 (rank 0) is killed at step 22 and replaced (a joiner that receives the state): the
    run stops at the 1-worker run's step, keeps its best-k checkpoints, and ends on its model."""
    reference = one_worker(model=MODEL, common=STOPPING, here=True)
    log, run, limit = tmp_path / "hooks.jsonl", tmp_path / "run", Limit(tmp_path / "limit", 30, last=60)
    proc = start(run, "launcher.workers=3", "launcher.restart_failed=true", f"+model_args.log={log}",
                 env={"EF_PROBE_KILL": "0:22:forward", "EF_PROBE_LIMIT": str(limit.path)}, model=MODEL,
                 common=STOPPING)
    limit.advance_until(run, lambda: events(run, "joined"), 120, "the replacement worker to join")
    limit.lift()
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    want, got = _stopped(reference), _stopped(run)
    assert got["step"] == want["step"] < 200, (got, want)
    assert got["reason"].startswith("early stopping: eval_loss=")
    joined = events(run, "joined")
    assert joined and joined[0]["state_received"], joined  # the joiner's patience came with the state
    # best-k: the two best eval_accuracy checkpoints, beside the newest (checkpoint.keep=1)
    assert _kept(run) == _kept(reference) and len(_kept(run)) == 3, (_kept(run), _kept(reference))
    done = _done(out)
    evals = [r for r in metrics(reference) if "eval_accuracy" in r]
    best = max(evals, key=lambda r: (r["eval_accuracy"], -r["step"]))["step"]
    assert re.search(rf"best_checkpoint=\S+/step_{best} ", done) and f"step_{best}" in _kept(run), done
    assert f"stopped_early={got['reason']} " in done, done
    assert_equivalent(run, reference)
    # the model file's rank-0 callback: saw the kill and the join at step boundaries, and added a key to the records
    hooks = [json.loads(line) for line in log.read_text().splitlines()]
    changes = [(h["step"], h["world_size"]) for h in hooks if h["hook"] == "membership_change"]
    assert [w for _, w in changes] == [2, 3] and changes[0][0] == 22, changes
    assert {h["hook"] for h in hooks} >= {"train_start", "eval_end", "save", "train_end"}
    records = [r for r in metrics(run) if "loss" in r]
    worlds = [r["probe_world"] for r in records if "probe_world" in r]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3
    # A record is written as the next step reduces: the one the new rank 0 wrote for step 21, when it was rank 1
    # and the rank-0 callback did not run on it, lacks the key (the docs say so: add keys from a ranks="all" one)
    assert {r["step"] for r in records if "probe_world" not in r} <= {21}


def test_a_rank_zero_callbacks_stop_is_voted_and_every_worker_ends_after_the_next_step(tmp_path):
    """A rank-0 callback asks to stop at step 12: with 1 worker and with 3 the run ends at step 13, the next
    step's reduction carrying the vote, and finishes as at its end (final checkpoint, fit()'s result)."""
    common = [c for c in COMMON if not c.startswith("trainer.max_steps")] + ["trainer.max_steps=40",
                                                                            "+model_args.stop_at=12"]
    steps = {}
    for workers in (1, 3):
        run = tmp_path / f"w{workers}"
        out = train_ok(run, f"launcher.workers={workers}", model=MODEL, common=common)
        steps[workers] = _stopped(run)["step"]
        assert "stopped_early=the probe asked at step 12 " in _done(out)
        assert _kept(run)[-1] == f"step_{steps[workers]}"
        assert [r["step"] for r in metrics(run) if "loss" in r][-1] == steps[workers]
    assert steps == {1: 13, 3: 13}


def test_a_resumed_run_that_stopped_early_stops_again_unless_patience_leaves_room(tmp_path):
    run = tmp_path / "run"
    common = [c for c in STOPPING if not c.startswith("trainer.micro_batch_size")]
    first = train_in_process(MODEL, run, *common)
    assert first.returncode == 0, first.stderr[-3000:]
    stopped = _stopped(run)["step"]
    again = train_in_process(MODEL, run, *common)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"early stopping had stopped this run at step {stopped}" in again.stderr
    assert [r["step"] for r in metrics(run) if "loss" in r][-1] == stopped  # not one step more
    more = train_in_process(MODEL, run, *common, "callbacks.early_stopping.patience=50", "trainer.max_steps=80")
    assert more.returncode == 0, more.stderr[-3000:]
    assert [r["step"] for r in metrics(run) if "loss" in r][-1] == 80


def test_the_learning_rate_monitor_from_config_and_a_callback_by_target(tmp_path):
    """callbacks.lr_monitor adds each group's rate; callbacks.extra builds a class by its dotted path (Hydra's
    _target_) with the entry's arguments."""
    run = tmp_path / "run"
    done = train_in_process(MODEL, run, *COMMON, "trainer.max_steps=12", "callbacks.lr_monitor=true",
                            "optimizer.schedule=linear", "optimizer.groups=[{params:[out/W],lr:0.01}]",
                            "callbacks.extra=[{_target_:elasticflow.EarlyStopping,monitor:loss,patience:1,"
                            "min_delta:10}]")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in metrics(run) if "loss" in r]
    assert records[0]["lr_group0"] == pytest.approx(records[0]["lr"] * 0.01 / 0.1)
    assert records[-1]["lr_group0"] < records[0]["lr_group0"]  # the schedule moves it too
    # min_delta=10: no step improves that much, so the first check after the first stops the run at step 2
    assert _stopped(run)["step"] == 2 and records[-1]["step"] == 2


def test_the_learning_rate_monitor_of_an_optimizer_without_groups_logs_its_one_rate(tmp_path):
    """No explicit groups: one group, whose rate the monitor adds as Lightning's does (it used to add nothing)."""
    run = tmp_path / "run"
    done = train_in_process(MODEL, run, *COMMON, "trainer.max_steps=6", "callbacks.lr_monitor=true",
                            "optimizer.schedule=linear")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["lr_group0"] for r in records] == [r["lr"] for r in records]
    assert records[-1]["lr_group0"] < records[0]["lr_group0"]  # the schedule moves it
    assert not any("lr_group1" in r for r in records)


@pytest.mark.parametrize("overrides, message", [
    (["callbacks.early_stopping.monitor=eval_acc", "trainer.eval_every=5"],
     "EarlyStopping monitors 'eval_acc', which this run does not produce (it has: loss, accuracy, eval_loss, "
     "eval_accuracy)"),
    (["checkpoint.monitor=eval_loss"], "checkpoint.monitor=eval_loss is judged at each evaluation, and this run "
                                       "evaluates only at its end"),
    (["callbacks.early_stopping.monitor=eval_loss"], "early stopping on eval_loss is checked at each evaluation, "
                                                     "and this run evaluates only at its end"),
    (["checkpoint.mode=median"], "checkpoint.mode must be one of min, max, got 'median'"),
    (["callbacks.early_stopping.monitor=loss", "callbacks.early_stopping.patience=0"],
     "callbacks.early_stopping.patience"),
    (["callbacks.extra=[{monitor:loss}]"], "has no _target_"),
    (["callbacks.extra=[{_target_:elasticflow.NoSuchCallback}]"], "callbacks.extra: could not build "
                                                                    "elasticflow.NoSuchCallback"),
    (["callbacks.extra=[{_target_:collections.OrderedDict}]"], "a callback is a OrderedDict, not an elasticflow "
                                                                "Callback"),
])
def test_a_callback_that_cannot_work_is_one_line_before_training(tmp_path, overrides, message):
    done = train_in_process(MODEL, tmp_path / "run", *COMMON, *overrides)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").rglob("step_*"))


@pytest.mark.parametrize("state", [
    {"callbacks": [1]}, {"callbacks": {"0:EarlyStopping": 3}},
])
def test_a_crafted_callbacks_record_is_a_corrupt_checkpoint(state):
    with pytest.raises(ValueError):
        TrainState().load_state_dict(state)


@pytest.mark.parametrize("state", [{"wait": -1}, {"wait": 1.5}, {"stopped_step": "x"}, {"best": "x"}])
def test_crafted_early_stopping_state_is_refused(state):
    with pytest.raises((ValueError, TypeError)):
        cb.EarlyStopping("loss").load_state_dict(state)


@pytest.mark.parametrize("state", [{"best": [[0.1]]}, {"best": "x"}, {"best": [[0.1, -2]]}])
def test_crafted_best_k_state_is_refused(state):
    with pytest.raises((ValueError, TypeError)):
        cb.BestCheckpoints("eval_loss").load_state_dict(state)


def test_best_k_ranks_and_keeps_the_k_best():
    class Trainer:  # the parts BestCheckpoints reads
        class state:
            last_metrics: dict = {}
            last_saved_step = None
        saved, protected = [], []
        step_count = 0

        def save_checkpoint(self, name, wait=True):
            self.saved.append(name)
            self.state.last_saved_step = self.step_count

        class checkpoints:
            @staticmethod
            def protect(names):
                Trainer.protected = list(names)
    best, trainer = cb.BestCheckpoints("eval_accuracy", "max", 2), Trainer()
    for step, value in [(5, 0.5), (10, 0.7), (15, 0.6), (20, 0.4), (25, 0.9)]:
        trainer.step_count = step
        best.on_eval_end(trainer, {"eval_accuracy": value})
    assert trainer.saved == ["step_5", "step_10", "step_15", "step_25"]  # step 20 was not among the best two
    assert Trainer.protected == ["step_25", "step_10"]
    again = cb.BestCheckpoints("eval_accuracy", "max", 2)
    again.load_state_dict(json.loads(json.dumps(best.state_dict())))
    assert again.names() == ["step_25", "step_10"]


def test_a_stop_asked_after_a_nested_hook_is_still_the_every_rank_callbacks():
    """A ranks="all" callback whose hook saves (on_save runs inside it) and then asks to stop: the stop is at
    this boundary, not a rank-0 vote (the nested call once forgot whose hook was running)."""
    class Trainer:
        rank = 1

    class SavesThenStops(cb.Callback):
        ranks = "all"

        def on_eval_end(self, trainer, metrics):
            callbacks.call("on_save", trainer, "step_5", None)
            callbacks.request_stop("enough")

    callbacks = cb.Callbacks([SavesThenStops(), cb.Callback()])
    callbacks.call("on_eval_end", Trainer(), {})
    assert (callbacks.stopping, callbacks.vote) == ("enough", None)


def test_the_docs_print_best_announces_each_best_once_across_a_kill_of_rank_0(tmp_path, one_worker):
    """docs/callbacks.md's PrintBest, as a user copies it into a model file: 3 workers, rank 0 SIGKILLed at
    step 57. Each improvement is printed once, at the steps where the 1-worker run's eval_loss improved. The
    kill comes after step 55's best: step 60's eval_loss is a little worse (0.2631 against 0.2627), and a
    rank-0-only callback, starting again from no best on the new rank 0, announced it (the docs' old
    example)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "callbacks.md").read_text()
    example = page[page.index("class PrintBest"):page.index("    return [PrintBest()]") + len("    return [PrintBest()]")]
    probe = Path(__file__).parent / "models"
    model = tmp_path / "print_best.py"
    model.write_text(f"import sys\nsys.path.insert(0, {str(probe)!r})\n"
                     "from callback_probe import data, eval_data, forward, model  # noqa: E402,F401\n"
                     f"import elasticflow  # noqa: E402\n\n\n{example}\n")
    common = [c for c in STOPPING if not c.startswith(("callbacks.", "checkpoint.", "trainer.max_steps"))] + [
        "trainer.max_steps=70"]
    reference = one_worker(model=MODEL, common=common, here=True)
    run = tmp_path / "run"
    out = finish(start(run, "launcher.workers=3", env={"EF_PROBE_KILL": "0:57:forward"}, model=model,
                       common=common))
    assert "new best" in out and events(run, "left"), out[-4000:]
    printed = [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"step (\d+): new best eval_loss ([\d.]+)", out)]
    best, want = None, []
    for r in (r for r in metrics(reference) if "eval_loss" in r):
        if best is None or r["eval_loss"] < best:
            best = r["eval_loss"]
            want.append(r["step"])
    assert [step for step, _ in printed] == want, (printed, want)
    assert all(b < a for (_, a), (_, b) in zip(printed, printed[1:])), printed

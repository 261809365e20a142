"""The walking skeleton: `elasticflow train models/linear.py` trains and writes what it promises."""
import elasticflow.checkpoint as ckpt

from harness import losses, metrics, train


def test_linear_trains_end_to_end(tmp_path):
    run = tmp_path / "run"
    proc = train("linear.py", run, "trainer.max_steps=120", "trainer.log_every=1")
    assert "done:" in proc.stdout
    steps = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 121))
    for key in ("step", "epoch", "loss", "lr", "samples_seen", "world_size", "step_time_s"):
        assert key in steps[0]
    assert steps[-1]["samples_seen"] == 120 * 64
    assert losses(run)[-1] < 0.05 < losses(run)[0]
    final = ckpt.latest(run / "checkpoints")
    assert final is not None and final.name == "step_120"
    state = ckpt.load(final)
    assert state["W"].shape == (8, 2) and state["b"].shape == (2,)
    assert (run / ".hydra" / "config.yaml").is_file()

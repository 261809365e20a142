"""TrainState: the one object that carries a run's progress into checkpoints and across replicas."""
import dataclasses
import json

from elasticflow import checkpoint as ckpt
from elasticflow.config.schema import compose
from elasticflow.data.order import Cursor
from elasticflow.replica.replica import Agreed, Replica
from elasticflow.train.state import TrainState
from elasticflow.trainer import ElasticTrainer

from harness import MODELS


def test_state_dict_round_trips_through_json():
    state = TrainState(step=7, micro_step=21, skipped_steps=1, cursor=Cursor(2, 32, 480), last_saved_step=5,
                       last_metrics={"step": 7, "loss": 0.25})
    restored = TrainState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored == state
    assert restored.epochs_completed == 2


def test_missing_fields_take_their_defaults():
    # A checkpoint written before a field existed, with metadata keys that are not progress.
    restored = TrainState(step=99, skipped_steps=4)
    restored.load_state_dict({"step": 12, "cursor": {"epoch": 1, "samples_in_epoch": 0, "samples_seen": 120},
                              "backend": "torch", "world_size": 3})
    assert (restored.step, restored.skipped_steps, restored.last_saved_step) == (12, 0, None)
    assert restored.cursor == Cursor(1, 0, 120)


def _trainer(run_dir, *overrides):
    model = MODELS / "linear.py"
    cfg = compose(str(model), ["trainer.log_every=1", "trainer.progress=false", "trainer.global_batch_size=16",
                               *overrides])
    return ElasticTrainer(str(model), cfg, run_dir=str(run_dir))


def test_every_field_is_checkpointed_and_resumed(tmp_path):
    first = _trainer(tmp_path, "trainer.max_steps=9")
    first.fit()
    resumed = _trainer(tmp_path, "trainer.max_steps=9").prepare()
    assert resumed.resumed_from is not None
    assert resumed.state.state_dict() == first.state.state_dict()
    meta = ckpt.read_metadata(ckpt.latest(tmp_path / "checkpoints"))
    assert {f.name for f in dataclasses.fields(TrainState)} <= set(meta)


def test_a_new_counter_needs_no_other_change(tmp_path, monkeypatch):
    """Adding a progress counter is one new field: checkpoints carry it and resume restores it."""
    @dataclasses.dataclass
    class WithTokens(TrainState):
        tokens_seen: int = 0

    monkeypatch.setattr("elasticflow.trainer.TrainState", WithTokens)
    first = _trainer(tmp_path, "trainer.max_steps=4").prepare()
    first.state.tokens_seen = 1234
    first.fit()
    resumed = _trainer(tmp_path, "trainer.max_steps=4").prepare()
    assert resumed.state.tokens_seen == 1234


def test_single_process_replica_reduces_nothing_and_passes_the_stop_vote_through():
    replica = Replica(None, engine=None, state_dict=lambda: ({}, {}), load_state_dict=lambda a, p: None)
    assert (replica.rank, replica.world, replica.generation) == (0, 1, 0)
    assert replica.reduce_step([1.5, 2.0], interrupt=True) == ([1.5, 2.0], Agreed(interrupt=True), None)
    assert replica.reduce_sum([3.0]) == [3.0]
    assert replica.join(samples_seen=0) is None
    assert replica.sync_state(samples_seen=10) is False

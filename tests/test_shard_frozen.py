"""trainer.shard=parameters with frozen parameters (elasticflow/replica/frozen_shards.py): a transformers GPT-2 with
peft's LoRA adapters (tests/models/lora_probe.py, models/gpt2_lora.py made wider), whose frozen base each worker
holds in ranges, with no gradient and no optimizer state, and brings in per block; on real processes.
"""
import json

import numpy as np
import pytest

import elasticflow.checkpoint as ckpt
from harness import MODELS, Limit, assert_equivalent, events, lose_join_retire, start, train_ok

from elasticflow._util.pages import ENV_STRICT as STRICT

pytest.importorskip("peft")

LORA = MODELS.parent / "tests" / "models" / "lora_probe.py"
ARGS = ["trainer.micro_batch_size=8", "trainer.shard_units=[net.base_model.model.transformer.h.*]",
        "checkpoint.interval.steps=10", "checkpoint.keep=null"]
COMMON = ["trainer.global_batch_size=32", "trainer.max_steps=30", "trainer.log_every=1", "trainer.progress=false",
          "trainer.eval_every=null", "elastic.timeout_s=60", "elastic.heartbeat_timeout_s=10", "elastic.wait_s=60"]


@pytest.fixture(scope="module")
def reference(one_worker):
    return one_worker(*ARGS, model=LORA, common=COMMON, here=True)  # here: peft is imported once, not again


def _resident(folder):
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_a_lora_base_is_held_in_ranges_and_survives_a_kill_a_join_and_a_scale_down(tmp_path, reference):
    """3 workers. Each holds two thirds of the frozen base (its own range and its buddy's) between blocks. Worker
    2 dies in a backward as it brings a block's frozen weights in: the survivors redo the step from the buddy
    copies of its ranges, trainable and frozen; a joiner then receives its ranges from its peers and one worker
    retires. The run ends on the 1-worker model (1e-5), its checkpoint holds the base whole (each owner wrote its
    range), and resumes into trainer.shard=none on that model."""
    run, seen, limit = tmp_path / "run", tmp_path / "resident", Limit(tmp_path / "limit", 12, last=28)
    seen.mkdir()
    proc = start(run, "launcher.workers=3", "launcher.max_workers=3", "trainer.shard=parameters", *ARGS,
                 model=LORA, common=COMMON, env={"EF_LORA_KILL": "2:8", "EF_LORA_RESIDENT": str(seen),
                                                 "EF_PROBE_LIMIT": str(limit.path)})
    lose_join_retire(run, proc, limit)
    assert_equivalent(run, reference, records=False)
    kinds = [e["event"] for e in events(run)]
    assert "fell_back" not in kinds and kinds.count("recovered") == 1, kinds

    rows = [r for r in _resident(seen) if r["step"] > 0]
    at = {w: [r["resident"] / r["total"] for r in rows if r["world"] == w] for w in (2, 3)}
    assert len(at[3]) >= 3 * 8 and len(at[2]) >= 2 * 5
    # At 3 workers: two thirds of the base, and the root's (wte, wpe, ln_f: 3%, in for the whole micro-batch)
    assert 0.66 <= min(at[3]) and max(at[3]) <= 0.72, at[3]
    assert min(at[2]) >= 0.99  # at 2, own and buddy: the whole base

    final = ckpt.latest(run / "checkpoints")
    state, want = ckpt.load(final), ckpt.load(ckpt.latest(reference / "checkpoints"))
    base = "net.base_model.model.transformer.h.3.mlp.c_fc.weight"
    assert np.array_equal(state[base], want[base])  # frozen: the same bits
    assert not any(k.startswith("optimizer/") and ".lora_" not in k for k in state)  # no state for the base
    resumed = tmp_path / "resumed"
    at_20 = next(p for p in ckpt.complete_checkpoints(run / "checkpoints") if p.name == "step_20")
    train_ok(resumed, f"resume={at_20}", *ARGS, model=LORA, common=COMMON)
    assert_equivalent(resumed, reference, records=False)


def test_a_neighbours_pair_killed_falls_back_to_the_checkpoint_holding_the_base_in_ranges(tmp_path, reference):
    """4 workers, workers 1 and 2 (neighbours: an owner and its buddy) SIGKILLed in the same step: a range has no
    holder left, so the 2 survivors load the step-10 checkpoint, in which each owner wrote its range of the
    frozen base, keep their ranges of it, redo the steps since and end on the 1-worker model. With strict pages:
    the checkpoint's load maps the whole vector before writing it, as a GPU's must."""
    run = tmp_path / "run"
    train_ok(run, "launcher.workers=4", "trainer.shard=parameters", *ARGS, model=LORA, common=COMMON,
             env={"EF_PROBE_KILL": "1:14:forward,2:14:forward", STRICT: "1"})
    assert [e["step"] for e in events(run, "fell_back")] == [10]
    assert_equivalent(run, reference, records=False)

"""Token-weighted losses on ragged text, the way Hugging Face users train a causal language model.

tests/models/ragged_gpt2.py trains a ``transformers`` GPT-2 on a ragged ``datasets.Dataset``; its ``collate``
pads each micro-batch (``DataCollatorForLanguageModeling``, labels -100 where padded) and ``forward`` returns
the loss with its number of target tokens as ``weight``. The reference is the hand-written loop that takes the
token mean over each whole global batch: three workers, one SIGKILLed mid-run, reach its model. Weighted by
samples instead (the loss alone), the same run does not, so the comparison can fail.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import elasticflow.checkpoint as ckpt
from harness import fit_here, metrics, train
from elasticflow.data import order as efdata
from elasticflow.errors import ElasticFlowError

sys.path.insert(0, str(Path(__file__).parent / "models"))
import ragged_gpt2 as lm  # noqa: E402

MODEL = Path(__file__).parent / "models" / "ragged_gpt2.py"
STEPS, BATCH, MICRO = 6, 24, 4
COMMON = [f"trainer.global_batch_size={BATCH}", f"trainer.micro_batch_size={MICRO}", f"trainer.max_steps={STEPS}",
          "trainer.log_every=1", "backend.threads=1", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5"]


def hand_written(optimizer):
    """The token mean over each whole global batch (one forward over its 24 samples, padded together)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = lm.build()
        opt = lm.optimizer(net, optimizer)
        rows = lm.data()["input_ids"]
        order = efdata.permutation(len(rows), 0, 0)
        losses, tokens = [], []
        for step in range(STEPS):
            batch = lm.collate([{"input_ids": rows[i]} for i in order[step * BATCH:(step + 1) * BATCH]])
            opt.zero_grad()
            loss = net(**batch).loss  # the library's mean over every target token of the global batch
            loss.backward()
            opt.step()
            losses.append(loss.item())
            tokens.append(int((batch["labels"][:, 1:] != -100).sum()))
        return {n: p.detach().numpy() for n, p in net.named_parameters()}, losses, tokens
    finally:
        torch.set_num_threads(threads)


def final(run_dir):
    got = ckpt.load(ckpt.latest(Path(run_dir) / "checkpoints"))
    return {k[len("net."):]: v for k, v in got.items() if k.startswith("net.")}


def difference(got, want):
    """|got - want| / |want| over the whole model (the norm of every parameter together)."""
    num = sum(float(np.sum((got[n].astype(np.float64) - w) ** 2)) for n, w in want.items())
    return (num / sum(float(np.sum(w.astype(np.float64) ** 2)) for w in want.values())) ** 0.5


# Rounding alone, the hand-written loop itself cut into micro-batches of 4 (each loss times its tokens over the
# batch's), moves the model by 2.3e-8 under SGD and by 1.1e-6 under AdamW (its update divides by the gradient's
# root mean square, so near-zero gradients' rounding shows): the bound sits above each.
# trainer.shard=parameters (ZeRO 3) with GPT-2's blocks as its units: the tied embedding and head, in the root, are
# in for every micro-batch; each block comes in for its forward and its backward.
STAGE_3 = ["trainer.shard=parameters", "trainer.shard_units=[net.transformer.h.*]"]


@pytest.mark.parametrize("optimizer,bound,shard", [("sgd", 1e-6, []), ("adamw", 1e-5, []), ("sgd", 1e-6, STAGE_3)],
                         ids=["sgd", "adamw", "sgd_parameters_sharded"])
def test_three_workers_one_killed_equal_the_token_mean_over_each_global_batch(tmp_path, optimizer, bound, shard):
    want, want_losses, want_tokens = hand_written(optimizer)
    run = tmp_path / "three"
    train(MODEL, run, *COMMON, f"+model_args.optimizer={optimizer}", "launcher.workers=3", *shard,
          env={"EF_LM_KILL": "1:3"})
    records = [r for r in metrics(run) if "loss" in r]
    assert [r["world_size"] for r in records][0] == 3 and records[-1]["world_size"] == 2
    assert [r["weight"] for r in records] == want_tokens  # the global batch's target tokens, logged each step
    np.testing.assert_allclose([r["loss"] for r in records], want_losses, rtol=1e-6)
    assert difference(final(run), want) <= bound

    if optimizer != "sgd" or shard:
        return
    # Weighted by samples (forward() returns the loss alone): micro-batches of few tokens count as much as
    # long ones, and the model moves away from the token mean's (0.045 under AdamW too).
    unweighted = tmp_path / "by_samples"
    fit_here(MODEL, unweighted, *COMMON, f"+model_args.optimizer={optimizer}", "+model_args.weighted=0")  # in here:
    # transformers is imported here already
    assert difference(final(unweighted), want) > 1e-2  # measured: 0.038

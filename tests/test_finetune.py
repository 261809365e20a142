"""Fine-tuning as users write it: frozen parameters and AdamW parameter groups, on a ``transformers`` BERT.

The reference is the hand-written loop every Hugging Face user knows: ``torch.optim.AdamW`` over the
groups (no weight decay on biases and LayerNorm weights, 10x the learning rate for the classifier head),
the same global batches in the same order. One worker matches it bit for bit; three workers with one
SIGKILLed mid-run match one worker to float32 rounding (their reduction sums in another order).
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import elasticflow.checkpoint as ckpt
from harness import assert_equivalent, fit_here, losses, metrics, train, train_in_process
from elasticflow.data import order as efdata
from elasticflow import optim
from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.trainer import ElasticTrainer

sys.path.insert(0, str(Path(__file__).parent / "models"))
import finetune_bert as fb  # noqa: E402

MODEL = Path(__file__).parent / "models" / "finetune_bert.py"
STEPS, BATCH = 6, 32
FROZEN = "bert.embeddings.word_embeddings.weight"
# The same groups as finetune_bert.groups(), from the config.
GROUPS = ["optimizer=adamw", "optimizer.lr=1e-3", "optimizer.weight_decay=0.1", "optimizer.no_decay=[bias,norm]",
          "optimizer.groups=[{params:[classifier],lr:0.01}]"]
COMMON = [f"trainer.global_batch_size={BATCH}", f"trainer.max_steps={STEPS}", "trainer.progress=false",
          "trainer.log_every=1"]


def reference(steps=STEPS):
    """The hand-written loop: torch.optim.AdamW with the groups, on the trainer's global batches."""
    net = fb.build()
    opt = torch.optim.AdamW(fb.groups(net), lr=1e-3)
    ids, labels = fb.data()
    order = efdata.permutation(len(ids), 0, 0)
    for step in range(steps):
        rows = order[step * BATCH:(step + 1) * BATCH]
        opt.zero_grad()
        net(input_ids=torch.from_numpy(ids[rows]), labels=torch.from_numpy(labels[rows])).loss.backward()
        opt.step()
    return net, opt


def trained(run_dir, *overrides, groups=GROUPS):
    """A training in this process (harness.fit_here); its final checkpoint's tensors."""
    fit_here(MODEL, run_dir, *groups, *COMMON, "backend.threads=1", *overrides)
    return final(run_dir)


def final(run_dir):
    """The last checkpoint's tensors, with model()'s {"net": ...} prefix taken off the names."""
    got = ckpt.load(ckpt.latest(Path(run_dir) / "checkpoints"))
    return {k.replace("net.", "", 1).replace("optimizer/net.", "optimizer/"): v for k, v in got.items()}


@pytest.fixture(scope="module")
def hand_written():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("where", ["config", "model"])
def test_groups_and_a_frozen_embedding_equal_a_hand_written_adamw_loop(tmp_path, hand_written, where):
    # model()'s own AdamW carries the groups: the config's would be refused beside it (model_file._refuse_unused)
    got = trained(tmp_path, "+model_args.native=1", groups=()) if where == "model" else trained(tmp_path)
    net, opt = hand_written
    for name, p in net.named_parameters():
        np.testing.assert_array_equal(got[name], p.detach().numpy(), err_msg=name)
        if p.requires_grad:
            np.testing.assert_array_equal(got[f"optimizer/{name}/exp_avg"], opt.state[p]["exp_avg"].numpy())
    # The frozen embedding: its initial values, checkpointed, and no optimizer state.
    np.testing.assert_array_equal(got[FROZEN], fb.build().bert.embeddings.word_embeddings.weight.detach().numpy())
    assert not any(k.startswith(f"optimizer/{FROZEN}") for k in got)
    # Non-persistent buffers (position ids) are the module's, not state.
    assert not any("position_ids" in k or "token_type_ids" in k for k in got)


def test_frozen_parameters_stay_put_under_sgd_with_weight_decay(tmp_path):
    got = trained(tmp_path, "optimizer=sgd", "optimizer.lr=0.5", "optimizer.momentum=0.9",
                  "optimizer.weight_decay=0.1", "optimizer.no_decay=[]", "optimizer.groups=[]")
    np.testing.assert_array_equal(got[FROZEN], fb.build().bert.embeddings.word_embeddings.weight.detach().numpy())


KILLED = GROUPS + COMMON + ["trainer.micro_batch_size=8", "elastic.timeout_s=10", "elastic.heartbeat_timeout_s=5"]


@pytest.fixture(scope="module")
def one_worker_bert(tmp_path_factory):
    """The 1-worker run of the killed runs' job. One worker holds the whole optimizer state with trainer.shard
    =optimizer too: its run is the same, bit for bit, so both shardings are compared with this one. Trained in this
    process (harness.fit_here)."""
    run = tmp_path_factory.mktemp("bert") / "one"
    fit_here(MODEL, run, *KILLED, "trainer.shard=none")
    return run


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_three_workers_one_killed_equal_one_worker(tmp_path, one_worker_bert, shard):
    train(MODEL, tmp_path / "three", *KILLED, f"trainer.shard={shard}", "launcher.workers=3", env={"EF_FT_KILL": "1:3"})
    sizes = [r["world_size"] for r in metrics(tmp_path / "three") if "loss" in r]
    assert sizes[0] == 3 and sizes[-1] == 2, sizes
    # attention's key bias has no gradient but rounding's (~1e-9): a floor of 1e-7 where it stays near zero
    assert_equivalent(tmp_path / "three", one_worker_bert, floor=1e-7, rng=True)
    one, three = final(one_worker_bert), final(tmp_path / "three")
    np.testing.assert_array_equal(three[FROZEN], one[FROZEN])
    assert len(losses(tmp_path / "three")) == STEPS


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_freezing_on_resume_goes_on_and_unfreezing_under_adam_is_refused(tmp_path, shard):
    # Both trainings in this process (trained(); resume=auto: the second resumes the first's checkpoint), as the
    # comparisons with the hand-written loop above run: a CLI job would only add its processes' imports.
    first = trained(tmp_path, f"trainer.shard={shard}", "trainer.max_steps=2", "+model_args.frozen=0")
    # frozen from here: its Adam state in the checkpoint is left unread
    second = trained(tmp_path, f"trainer.shard={shard}", "trainer.max_steps=4")
    np.testing.assert_array_equal(second[FROZEN], first[FROZEN])
    run = [MODEL, tmp_path, *GROUPS, *COMMON, f"trainer.shard={shard}"]
    assert len(losses(tmp_path)) == 4
    out = train_in_process(*run, "trainer.max_steps=6", "+model_args.frozen=0")  # refused before a step
    assert out.returncode != 0
    assert f"parameter '{FROZEN}' trains now but was frozen when the checkpoint was written" in out.stderr, out.stderr
    assert "hint: keep it frozen until this run ends" in out.stderr
    assert len(losses(tmp_path)) == 4  # nothing trained, nothing overwritten


def test_a_group_pattern_that_matches_nothing_is_one_error_line(tmp_path):
    out = train_in_process(MODEL, tmp_path, *COMMON, "optimizer=adamw",
                           "optimizer.groups=[{params:[classifer],lr:0.01}]")
    assert out.returncode != 0
    assert "optimizer group 0 pattern 'classifer' matches no trainable parameter" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------- the rules, unit by unit
def test_patterns_pick_by_name_by_module_class_or_by_glob():
    spec = optim.AdamW(1e-3, weight_decay=0.1, no_decay=["bias", "norm"],
                       groups=[optim.Group(["head.*"], lr=1e-2), optim.Group("enc", weight_decay=0.5)])
    names = ["enc.w", "ln_f.weight", "head.w", "enc.bias", "head.bias", "other.w"]
    h = optim.hypers(spec, names, owners={"ln_f.weight": "LayerNorm"})
    assert h["enc.w"] == optim.Hyper(1.0, 0.5) and h["enc.bias"] == optim.Hyper(1.0, 0.5)  # a group's own wd wins
    assert h["ln_f.weight"] == optim.Hyper(1.0, 0.0)  # "norm" matches the owning module's class
    assert h["head.w"].lr_scale == pytest.approx(10.0) and h["head.w"].weight_decay == 0.1
    assert h["head.bias"].weight_decay == 0.0 and h["other.w"] == optim.Hyper(1.0, 0.1)
    order = optim.grouped_order(names, h)
    assert order == ["enc.w", "enc.bias", "ln_f.weight", "head.w", "head.bias", "other.w"]  # a group's together
    assert [(lo, hi) for lo, hi, _ in optim.runs(order, [1, 2, 1, 1, 1, 3], h)] == [(0, 3), (3, 4), (4, 5), (5, 6),
                                                                                    (6, 9)]


def test_torch_optimizers_that_the_flat_update_cannot_compute_are_refused():
    from elasticflow.backends.torch.optim import spec_from_native

    net = torch.nn.Linear(2, 2)
    with pytest.raises(ElasticFlowError, match="AdamW with amsgrad"):
        spec_from_native(torch.optim.AdamW(net.parameters(), amsgrad=True))
    with pytest.raises(ElasticFlowError, match="param group 1 sets its own betas"):
        spec_from_native(torch.optim.Adam([{"params": [net.weight]}, {"params": [net.bias], "betas": (0.8, 0.9)}]))
    with pytest.raises(ElasticFlowError, match="torch.optim.RMSprop"):
        spec_from_native(torch.optim.RMSprop(net.parameters()))
    spec = spec_from_native(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    assert isinstance(spec, optim.SGD) and spec.momentum == 0.9 and spec.groups[0].weight_decay == 1e-4
    assert spec_from_native(object()) is None


LSTM_LM = '''
import numpy as np
import torch
from torch import nn

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 20)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])

def model(cfg):
    torch.manual_seed(1)
    return LM()

def forward(ids, net):
    logits = net(ids[:, :-1].long())
    return nn.functional.cross_entropy(logits.reshape(-1, 20), ids[:, 1:].reshape(-1).long())

def data(cfg):
    return (np.random.default_rng(3).integers(0, 20, size=(96, 9)),)
'''


def test_an_lstm_language_model_with_sgd_groups_equals_torch_optim_sgd(tmp_path):
    path = tmp_path / "lstm_lm.py"
    path.write_text(LSTM_LM)
    cfg = compose(str(path), ["optimizer=sgd", "optimizer.lr=0.5", "optimizer.momentum=0.9", "optimizer.nesterov=true",
                              "optimizer.weight_decay=0.01", "optimizer.no_decay=[bias]",
                              "optimizer.groups=[{params:[head],lr:0.1}]", "trainer.global_batch_size=16",
                              "trainer.max_steps=5", "trainer.progress=false", "backend.threads=1"])
    ElasticTrainer(str(path), cfg, run_dir=str(tmp_path / "run")).fit()
    got = final(tmp_path / "run")
    scope: dict = {}
    exec(LSTM_LM, scope)
    net = scope["model"](None)
    named = dict(net.named_parameters())
    sgd_groups = [
        {"params": [p for n, p in named.items() if not n.startswith("head") and "bias" not in n], "weight_decay": 0.01},
        {"params": [p for n, p in named.items() if not n.startswith("head") and "bias" in n], "weight_decay": 0.0},
        {"params": [named["head.weight"]], "weight_decay": 0.01, "lr": 0.1},
        {"params": [named["head.bias"]], "weight_decay": 0.0, "lr": 0.1}]
    opt = torch.optim.SGD(sgd_groups, lr=0.5, momentum=0.9, nesterov=True)
    (ids,) = scope["data"](None)
    order = efdata.permutation(len(ids), 0, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(5):
            opt.zero_grad()
            scope["forward"](torch.from_numpy(ids[order[step * 16:(step + 1) * 16]]), net).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    for name, p in named.items():
        np.testing.assert_array_equal(got[name], p.detach().numpy(), err_msg=name)

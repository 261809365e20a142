"""The start banner's warning: a model that draws random numbers in training (dropout), or takes BatchNorm
statistics, trains the same model one worker would only with trainer.micro_batch_size; without it the
banner says so and what to set."""
from __future__ import annotations

import logging

import pytest

from elasticflow.train import randomness
from elasticflow.config.schema import compose
from elasticflow.trainer import ElasticTrainer

ENCODER = '''
import numpy as np
import torch
from torch import nn


def model(cfg):
    torch.manual_seed(cfg.seed)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=cfg.model_args.dropout,
                                       batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False), nn.Flatten(),
                         nn.Linear(32, 1))


def forward(x, y, net):
    return nn.functional.mse_loss(net(x), y)


def data(cfg):
    x = np.random.default_rng(0).normal(size=(64, 4, 8)).astype(np.float32)
    return x, x[:, :1, 0] * 2
'''

DICT_MODEL = '''
import numpy as np
from elasticflow import ops


def model(cfg):
    return {{"W": np.zeros((4, 1), np.float32)}}


def forward(x, y, params):
    return ops.mse(ops.dropout(x, {rate}) @ params["W"], y)


def data(cfg):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    return x, x[:, :1] * 2
'''


def banner_warnings(path, tmp_path, caplog, *overrides) -> list:
    cfg = compose(str(path), ["trainer.max_steps=1", "trainer.progress=false", "trainer.loggers=[]", *overrides])
    with caplog.at_level(logging.INFO, logger="elasticflow"):
        caplog.clear()
        ElasticTrainer(str(path), cfg, run_dir=str(tmp_path / f"run{len(list(tmp_path.glob('run*')))}")).fit()
    return [r.getMessage() for r in caplog.records if "micro_batch_size" in r.getMessage()]


def test_a_transformer_encoder_with_dropout_is_warned_about_and_told_what_to_set(write_model, tmp_path, caplog):
    path = write_model(ENCODER)
    warned = banner_warnings(path, tmp_path, caplog, "+model_args.dropout=0.1", "launcher.max_workers=3")
    assert len(warned) == 1, warned
    # 64 over up to 3 workers: micro-batches of 16 (the largest divisor of 64 that gives 3 workers one each).
    assert "warning: without trainer.micro_batch_size" in warned[0] and "0.layers.0.self_attn" in warned[0]
    assert "depend on the number of workers; set trainer.micro_batch_size=16 " in warned[0]
    assert "(global batch 64 = 4 micro-batches of 16)" in warned[0]
    # Not when the micro-batch is set, nor when nothing draws.
    assert banner_warnings(path, tmp_path, caplog, "+model_args.dropout=0.1", "trainer.micro_batch_size=16") == []
    assert banner_warnings(path, tmp_path, caplog, "+model_args.dropout=0.0", "launcher.max_workers=3") == []


def test_reduced_precision_is_warned_about_like_dropout(write_model, tmp_path, caplog):
    # bf16 rounds each worker's share of a step, so how the global batch is cut shows in the result.
    path = write_model(ENCODER)
    warned = banner_warnings(path, tmp_path, caplog, "+model_args.dropout=0.0", "trainer.precision=bf16")
    assert len(warned) == 1 and "the bfloat16 rounding of each worker's share" in warned[0], warned
    assert "set trainer.micro_batch_size=32 " in warned[0]
    assert banner_warnings(path, tmp_path, caplog, "+model_args.dropout=0.0", "trainer.precision=bf16",
                           "trainer.micro_batch_size=16") == []


def test_a_dict_model_calling_ops_dropout_is_found_by_the_start_up_probe(write_model, tmp_path, caplog):
    warned = banner_warnings(write_model(DICT_MODEL.format(rate=0.2), "drop.py"), tmp_path, caplog)
    assert len(warned) == 1 and "ops.dropout in forward()" in warned[0] and "micro_batch_size=32 " in warned[0]
    assert banner_warnings(write_model(DICT_MODEL.format(rate=0.0), "none.py"), tmp_path, caplog) == []


def test_what_draws_in_torch_modules():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    assert randomness.sources(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0), nn.BatchNorm1d(2))) == []
    assert randomness.sources(nn.Sequential(nn.Linear(2, 2), nn.AlphaDropout(0.1))) == ["1"]
    assert randomness.sources(nn.MultiheadAttention(4, 2, dropout=0.1)) == ["MultiheadAttention"]
    assert randomness.sources(nn.LSTM(2, 2, num_layers=2, dropout=0.3)) == ["LSTM"]
    assert randomness.sources(nn.Sequential(nn.RReLU())) == ["0"]


def test_what_draws_in_keras_layers():
    keras = pytest.importorskip("keras")
    quiet = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.0)])
    assert randomness.sources(quiet) == []
    noisy = keras.Sequential([keras.Input((3, 4)), keras.layers.LSTM(3, recurrent_dropout=0.1, return_sequences=True),
                              keras.layers.GaussianNoise(0.1, name="noise"), keras.layers.Dropout(0.5, name="drop")])
    found = randomness.sources(noisy)
    assert "noise" in found and "drop" in found and any("lstm" in name for name in found)


def test_the_suggested_micro_batch_serves_every_worker_in_equal_pieces():
    assert randomness.suggested_micro_batch(64, 3) == 16
    assert randomness.suggested_micro_batch(64, 1) == 64
    assert randomness.suggested_micro_batch(96, 4) == 24
    assert randomness.suggested_micro_batch(30, 4) == 6
    assert randomness.warning([], False, 64, 2) is None
    assert "BatchNorm's batch statistics" in randomness.warning([], True, 64, 2)

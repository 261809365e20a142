"""ragged_gpt2.py's ``transformers`` GPT-2 (on its ragged text, padded per micro-batch, token-weighted) with
activation checkpointing as Hugging Face users turn it on: ``gradient_checkpointing_enable()``. transformers 5
checkpoints each block's ``forward`` (``GradientCheckpointingLayer``, FSDP2's convention), not its ``__call__``:
in backward each block's forward runs again without its module hooks.

model_args (all optional): ragged_gpt2's (optimizer, weighted, dropout), and
    reentrant: 1 -> gradient_checkpointing_kwargs={"use_reentrant": True} (default 0: transformers' default, False)
Environment: ragged_gpt2's EF_LM_KILL "worker:step" (that worker SIGKILLs itself in forward at that step).
"""
import warnings

import ragged_gpt2 as lm
from ragged_gpt2 import collate, data, forward  # noqa: F401 - the model file's data, collate and forward


def model(cfg):
    out = lm.model(cfg)
    with warnings.catch_warnings():  # transformers 5 names it activation_checkpointing_enable; users call this
        warnings.simplefilter("ignore", FutureWarning)
        out["net"].gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": bool(int(lm.arg(cfg, "reentrant", 0)))})
    return out

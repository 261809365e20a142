"""Other trainers' names for the settings ElasticFlow has: the hint an unknown key gets when it is one of them.

A Lightning ``Trainer`` argument, a Hugging Face ``TrainingArguments`` field, a torchrun flag or a Keras
``fit``/``compile`` argument typed as a config key (``trainer.accumulate_grad_batches=4``,
``+learning_rate=3e-4``) is refused like any unknown key, with a hint that names ElasticFlow's spelling instead of
the nearest string. A name is matched by its last component, in lower case, wherever it was put.
docs/coming-from-lightning-and-hf.md shows this table (``tests/test_config.py`` checks that it is this one).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

# name -> (whose it is, ElasticFlow's spelling and what to know)
SPELLINGS: Dict[str, Tuple[str, str]] = {
    "accumulate_grad_batches": ("Lightning", "trainer.global_batch_size and trainer.micro_batch_size: the step "
                                "accumulates global / (micro x workers) micro-batches, whatever the workers"),
    "gradient_accumulation_steps": ("Hugging Face", "trainer.global_batch_size and trainer.micro_batch_size: the "
                                    "step accumulates global / (micro x workers) micro-batches, whatever the "
                                    "workers"),
    "val_check_interval": ("Lightning", "trainer.eval_every=N (optimizer steps) with eval_data() in the model file"),
    "check_val_every_n_epoch": ("Lightning", "trainer.eval_every=N (optimizer steps) with eval_data() in the "
                                "model file"),
    "eval_steps": ("Hugging Face", "trainer.eval_every=N (optimizer steps) with eval_data() in the model file"),
    "eval_strategy": ("Hugging Face", "trainer.eval_every=N (optimizer steps) with eval_data() in the model file"),
    "evaluation_strategy": ("Hugging Face", "trainer.eval_every=N (optimizer steps) with eval_data() in the "
                            "model file"),
    "gradient_clip_val": ("Lightning", "trainer.grad_clip=MAX_NORM (the global norm, as clip_grad_norm_)"),
    "max_grad_norm": ("Hugging Face", "trainer.grad_clip=MAX_NORM (the global norm, as clip_grad_norm_)"),
    "clipnorm": ("Keras", "trainer.grad_clip=MAX_NORM (the global norm over every parameter)"),
    "max_epochs": ("Lightning", "trainer.epochs=N"),
    "num_train_epochs": ("Hugging Face", "trainer.epochs=N"),
    "devices": ("Lightning", "launcher.workers=N (how many), trainer.device=cpu or cuda (which kind)"),
    "gpus": ("Lightning", "launcher.workers=N with trainer.device=cuda"),
    "num_processes": ("Lightning", "launcher.workers=N"),
    "nproc_per_node": ("torchrun", "launcher.workers=N (one host), launcher.procs_per_node=N (several)"),
    "num_nodes": ("Lightning", "launcher=nodes or launcher=slurm with launcher.nodes=N"),
    "accelerator": ("Lightning", "trainer.device=cpu or cuda"),
    "strategy": ("Lightning", "trainer.shard: none (DDP), optimizer, gradients or parameters (FSDP / ZeRO-3)"),
    "bf16": ("Hugging Face", "trainer.precision=bf16"),
    "fp16": ("Hugging Face", "trainer.precision=16"),
    "learning_rate": ("Hugging Face / Keras", "optimizer.lr"),
    "warmup_ratio": ("Hugging Face", "optimizer.warmup_steps=N (steps, not a ratio)"),
    "lr_scheduler_type": ("Hugging Face", "optimizer.schedule=constant, cosine, linear or step with "
                          "optimizer.warmup_steps"),
    "lr_scheduler": ("Lightning / Hugging Face", "optimizer.schedule=constant, cosine, linear or step (or return "
                     "{'scheduler': ...} beside model()'s own optimizer)"),
    "per_device_train_batch_size": ("Hugging Face", "trainer.micro_batch_size (per forward) and "
                                    "trainer.global_batch_size (per step, whatever the workers)"),
    "batch_size": ("Keras / Lightning", "trainer.global_batch_size (per step, whatever the workers) and "
                   "trainer.micro_batch_size (per forward)"),
    "save_steps": ("Hugging Face", "checkpoint.interval.steps=N"),
    "every_n_train_steps": ("Lightning ModelCheckpoint", "checkpoint.interval.steps=N"),
    "save_total_limit": ("Hugging Face", "checkpoint.keep=N"),
    "metric_for_best_model": ("Hugging Face", "checkpoint.monitor=NAME with checkpoint.save_top_k"),
    "greater_is_better": ("Hugging Face", "checkpoint.mode=max"),
    "logging_steps": ("Hugging Face", "trainer.log_every=N"),
    "log_every_n_steps": ("Lightning", "trainer.log_every=N"),
    "output_dir": ("Hugging Face", "hydra.run.dir=DIR"),
    "default_root_dir": ("Lightning", "hydra.run.dir=DIR"),
    "report_to": ("Hugging Face", "trainer.loggers=[csv,mlflow,wandb] (TensorBoard is always written)"),
    "logger": ("Lightning", "trainer.loggers=[csv,mlflow,wandb] (TensorBoard is always written)"),
    "mlflow": ("Lightning / Hugging Face", "trainer.loggers=[mlflow] ($MLFLOW_TRACKING_URI says where)"),
    "wandb": ("Lightning / Hugging Face", "trainer.loggers=[wandb] ($WANDB_PROJECT, $WANDB_MODE)"),
    "resume_from_checkpoint": ("Hugging Face", "resume=auto (the run's newest good checkpoint) or resume=PATH"),
    "ckpt_path": ("Lightning", "resume=auto (the run's newest good checkpoint) or resume=PATH"),
    "early_stopping_patience": ("Hugging Face", "callbacks.early_stopping.monitor=NAME and "
                                "callbacks.early_stopping.patience=N"),
    "dataloader_num_workers": ("Hugging Face", "data.workers=N"),
    "num_workers": ("PyTorch DataLoader", "data.workers=N"),
    "deterministic": ("Lightning", "trainer.reproducible=true (bit-identical to 1 worker, whatever the workers)"),
    "full_determinism": ("Hugging Face", "trainer.reproducible=true (bit-identical to 1 worker, whatever the "
                         "workers)"),
}


def spelling(key: str) -> Optional[str]:
    """The hint for ``key`` (a full dotted key) when its last component is another trainer's name, else None."""
    name = key.rpartition(".")[2].lstrip("+").lower()
    if name not in SPELLINGS:
        return None
    whose, ours = SPELLINGS[name]
    return f"{name} is a {whose} name; in ElasticFlow: {ours}"

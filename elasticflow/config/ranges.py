"""The allowed range of every numeric key of the config schema, and the strings that must stay on one line.

``config.validate`` calls :func:`check_ranges` before its checks of choices and of keys against each other.
Each refusal is one line naming the key, the value and the range, with a hint. A numeric field added to a
dataclass in config/schema.py needs an entry in :data:`RANGES` (tests/test_config.py fails until it has one).
"""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass
from typing import Any, Dict

from ..errors import ElasticFlowError

# Counts of steps, epochs, samples: a count past the largest int32 is a typo (2**31 steps are weeks at a
# millisecond each), and below it every framework's int32 tensor holds the count exactly.
MAX_COUNT = 2**31 - 1
# Per-host counts of threads, processes and cores. A fixed cap, not a multiple of os.cpu_count(): the config is
# validated where the command runs (a SLURM login node, the first of several hosts), not on the hosts whose
# cores the workers use. 1024 is above the hardware threads of the largest hosts sold (2 x 192 cores x SMT 2).
MAX_PER_HOST = 1024
# GPUs on one node: far above the 4 to 16 of today's nodes; a larger number is a typo of another key's value.
MAX_GPUS_PER_NODE = 64
# Workers and nodes of one job: one agent and one store serve them all (membership, heartbeats), so a world
# past this is not a job the agent could hold; it is mostly a typo, or a product that overflowed.
MAX_WORKERS = 65536
# A PriorityClass value Kubernetes lets users create: higher ones are reserved for its system classes.
MAX_PRIORITY = 1_000_000_000
# Timeouts and waits: longer than any allocation. Past threading.TIMEOUT_MAX (~292 years) Python's own waits
# raise OverflowError mid-run, and a finite 1e300 would get there.
MAX_SECONDS = 7 * 24 * 3600
# Micro-batches read ahead: each is held in host memory until trained on; a few cover a slow read, and a
# reader far ahead only holds memory (1e9 would try to hold the dataset many times over).
MAX_PREFETCH = 1024
# np.random.seed (builder.py) takes 0 to 2**32 - 1 and raises on anything else, after the workers started.
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class Span:
    """The values a numeric key may take: ``low`` to ``high``, integers or finite numbers."""
    low: float
    high: float
    hint: str
    integer: bool = True
    open_low: bool = False   # ``low`` itself is refused (a float > 0)
    open_high: bool = False  # ``high`` itself is refused (a rate < 1)
    kind: str = ""           # the wording of the range, where the generic one would read worse

    def describe(self) -> str:
        if self.kind:
            return self.kind
        if self.integer:
            return "a positive integer" if self.low == 1 else f"an integer >= {int(self.low)}"
        low = f"{'>' if self.open_low else '>='} {self.low:g}"
        if math.isinf(self.high):
            return f"a finite number {low}"
        return f"a number in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"

    def refusal(self, key: str, value: Any) -> str:
        """The message for ``value`` of ``key``, or "" when it is in range."""
        if self.integer:
            if not isinstance(value, bool) and isinstance(value, int) and self.low <= value <= self.high:
                return ""
            if self.kind:  # the wording names the whole range
                return f"{key} must be {self.kind}, got {value!r}"
            low, high = int(self.low), int(self.high)
            wrong = (f"at most {high}" if isinstance(value, int) and value > high else self.describe())
            return f"{key} must be {wrong}, got {value!r} (allowed: {low} to {high})"
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
              and (value > self.low if self.open_low else value >= self.low)
              and (value < self.high if self.open_high else value <= self.high))
        return "" if ok else f"{key} must be {self.describe()}, got {value!r}"


def _int(low: int, high: int, hint: str, kind: str = "") -> Span:
    return Span(low, high, hint, kind=kind)


def _real(low: float, hint: str, high: float = math.inf, open_low: bool = False, open_high: bool = False,
          kind: str = "") -> Span:
    return Span(low, high, hint, integer=False, open_low=open_low, open_high=open_high, kind=kind)


def _steps(key: str, example: int, null: str = "") -> Span:
    return _int(1, MAX_COUNT, f"pass e.g. {key}={example}{null}")


# Every numeric key of config/schema.py's dataclasses. A null (an Optional key left unset) is always allowed;
# ``optimizer.groups[].KEY`` applies to each group, ``optimizer.betas`` to each of its two numbers.
RANGES: Dict[str, Span] = {
    "backend.threads": _int(1, MAX_PER_HOST, "pass e.g. backend.threads=4, or null for the host's cores "
                                             "divided among its workers"),
    "launcher.workers": _int(1, MAX_WORKERS, "pass launcher.workers=1 for a single worker"),
    "launcher.min_workers": _int(1, MAX_WORKERS, "pass launcher.min_workers=1"),
    "launcher.max_workers": _int(1, MAX_WORKERS, "pass e.g. launcher.max_workers=8, or null for no limit"),
    "launcher.max_restarts": _int(0, MAX_COUNT, "pass e.g. launcher.max_restarts=3 (0: never replace a worker)"),
    "launcher.procs_per_node": _int(1, MAX_PER_HOST, "pass e.g. launcher.procs_per_node=2"),
    "launcher.nodes": _int(1, MAX_WORKERS, "pass e.g. launcher.nodes=2"),
    "launcher.etcd.lease_s": _real(2, "pass e.g. launcher.etcd.lease_s=3 (etcd grants no lease under its election "
                                      "timeout, about 1.5 s)", high=60),
    "launcher.max_nodes": _int(1, MAX_WORKERS, "pass e.g. launcher.max_nodes=4, or null for the allocation only"),
    "launcher.tasks_per_node": _int(1, MAX_PER_HOST, "pass e.g. launcher.tasks_per_node=4"),
    "launcher.cpus_per_task": _int(1, MAX_PER_HOST, "pass e.g. launcher.cpus_per_task=8, or null for SLURM's "
                                                    "default"),
    "launcher.gpus_per_node": _int(1, MAX_GPUS_PER_NODE, "pass e.g. launcher.gpus_per_node=4, or null for no GPUs"),
    "launcher.port": _int(1, 65535, "pass a free TCP port, e.g. launcher.port=29400"),
    "launcher.core_priority": _int(0, MAX_PRIORITY, "pass e.g. launcher.core_priority=1000"),
    "launcher.elastic_priority": _int(0, MAX_PRIORITY, "pass e.g. launcher.elastic_priority=100"),
    "topology.aggregators": _int(1, MAX_WORKERS, "pass e.g. topology.aggregators=2 (aggregator processes, each "
                                                 "holding a shard)"),
    "topology.replica": _int(1, 2, "pass topology.replica=2 for a standby copy of each aggregator, else 1",
                             kind="1 or 2"),
    "topology.sync_every": _steps("topology.sync_every", 16),
    "topology.replicas": _int(1, MAX_WORKERS, "pass e.g. topology.replicas=4 (model replicas; each trains on its "
                                              "part of every global batch)"),
    "topology.group_size": _int(1, MAX_PER_HOST, "pass e.g. topology.group_size=4 (workers of a host per group), "
                                                 "or null for the whole host"),
    "topology.outer_lr": _real(0, "pass e.g. topology.outer_lr=0.7", open_low=True),
    "topology.outer_momentum": _real(0, "pass e.g. topology.outer_momentum=0.9 (0: none; 1 or more never forgets an "
                                        "update)", high=1, open_high=True),
    "optimizer.lr": _real(0, "pass e.g. optimizer.lr=0.01", open_low=True),
    "optimizer.momentum": _real(0, "pass e.g. optimizer.momentum=0.9 (0: none; 1 or more never forgets a "
                                   "gradient and diverges)", high=1, open_high=True),
    "optimizer.weight_decay": _real(0, "pass e.g. optimizer.weight_decay=0.01 (0: none)"),
    "optimizer.betas": _real(0, "pass e.g. optimizer.betas=[0.9,0.999] (decay rates of the two moments)",
                             high=1, open_high=True, kind="two numbers in [0, 1)"),
    "optimizer.eps": _real(0, "pass e.g. optimizer.eps=1e-8 (0 divides by zero where a gradient is 0)",
                           open_low=True),
    "optimizer.warmup_steps": _int(0, MAX_COUNT, "pass e.g. optimizer.warmup_steps=100, or 0 for no warmup"),
    "optimizer.decay_steps": _steps("optimizer.decay_steps", 10000, ", or null to decay over all training steps"),
    "optimizer.min_lr": _real(0, "pass e.g. optimizer.min_lr=0 (decay to zero)"),
    "optimizer.step_size": _steps("optimizer.step_size", 1000),
    "optimizer.gamma": _real(0, "pass e.g. optimizer.gamma=0.1 (each step_size steps multiply the rate by it)",
                             high=1, open_low=True),
    "optimizer.groups[].lr": _real(0, "pass a positive lr in the group, e.g. {params:[head],lr:1e-2}, or leave it "
                                      "out for optimizer.lr", open_low=True),
    "optimizer.groups[].weight_decay": _real(0, "pass e.g. {params:[head],weight_decay:0} in the group, or leave "
                                                "it out for optimizer.weight_decay"),
    "trainer.global_batch_size": _steps("trainer.global_batch_size", 64),
    "trainer.micro_batch_size": _int(1, MAX_COUNT, "set a positive micro-batch size, or null to use each worker's "
                                                   "whole share"),
    "trainer.max_steps": _steps("trainer.max_steps", 1000, ", or null"),
    "trainer.epochs": _steps("trainer.epochs", 10, ", or null"),
    "trainer.log_every": _int(1, MAX_COUNT, "set trainer.log_every=1 to log every step"),
    "trainer.loggers_wait_s": _real(0, "pass e.g. trainer.loggers_wait_s=60 (seconds the end of a run waits for its "
                                       "trackers; 0 leaves what is behind to `elasticflow sync RUN`)",
                                    high=MAX_SECONDS),
    "trainer.eval_every": _steps("trainer.eval_every", 500, ", or null to evaluate once at the end"),
    "trainer.grad_clip": _real(0, "set trainer.grad_clip=1.0, or null to disable clipping", open_low=True),
    "checkpoint.interval.steps": _steps("checkpoint.interval.steps", 100, ", or null not to save by steps"),
    "checkpoint.interval.epochs": _steps("checkpoint.interval.epochs", 1, ", or null not to save by epochs"),
    "checkpoint.keep": _int(1, MAX_COUNT, "set checkpoint.keep to keep the newest K, or null for all"),
    "checkpoint.save_top_k": _int(1, MAX_COUNT, "set checkpoint.save_top_k to keep the best K, or "
                                  "checkpoint.monitor=null for none"),
    "callbacks.early_stopping.patience": _int(1, MAX_COUNT, "pass the checks without improvement before "
                                              "stopping, e.g. callbacks.early_stopping.patience=3"),
    "callbacks.early_stopping.min_delta": _real(0, "pass e.g. callbacks.early_stopping.min_delta=0.001 (0: any "
                                                "improvement counts)"),
    "elastic.heartbeat_timeout_s": _real(0, "pass e.g. elastic.heartbeat_timeout_s=10 (seconds)", high=MAX_SECONDS,
                                         open_low=True),
    "elastic.timeout_s": _real(0, "pass e.g. elastic.timeout_s=30 (never leave collectives without a timeout)",
                               high=MAX_SECONDS, open_low=True),
    "elastic.wait_s": _real(0, "pass e.g. elastic.wait_s=60 (seconds), or 0 to stop at once", high=MAX_SECONDS),
    "elastic.shard_replicas": _int(0, 1, "pass elastic.shard_replicas=1 (a buddy copy of every slice) or 0 (none)",
                                   kind="0 or 1"),
    "elastic.straggler_factor": _real(1, "pass e.g. elastic.straggler_factor=2 (times the median member's time)",
                                      high=MAX_COUNT, open_low=True),
    "elastic.straggler_patience": _int(1, MAX_COUNT, "pass e.g. elastic.straggler_patience=20 (steps in a row)"),
    "elastic.verify_every": _steps("elastic.verify_every", 50, ", or null for no spot check"),
    "data.prefetch": _int(0, MAX_PREFETCH, "pass e.g. data.prefetch=2 (micro-batches read ahead), or 0 to read on "
                                           "demand"),
    "data.workers": _int(1, MAX_PER_HOST, "pass e.g. data.workers=2 (readers beyond the host's cores only "
                                          "contend for them)"),
    "comm.bucket_mb": _real(0, "pass e.g. comm.bucket_mb=25, or null to reduce the gradient in one piece",
                            kind="a size in MiB >= 0"),
    "seed": _int(0, MAX_SEED, "pass e.g. seed=0 (numpy seeds take 0 to 2**32 - 1)"),
}

ONE_LINE_HINT = ("launcher=slurm writes it into job.sbatch, where a newline would start a shell "
                 "line of its own: pass the value on one line")


def check_ranges(cfg: Any) -> None:
    """Raise ElasticFlowError for the first numeric key out of its range, a launcher.* string (what
    ``launchers/slurm.py batch_script`` writes) with a newline or control character, or a
    checkpoint.job_name that is not a plain name."""
    from omegaconf import OmegaConf

    def check(key: str, value: Any, span: Span) -> None:
        if value is not None and (message := span.refusal(key, value)):
            raise ElasticFlowError(message, span.hint)

    for key, span in RANGES.items():
        if key == "optimizer.betas":
            betas = list(cfg.optimizer.betas)
            if len(betas) != 2 or any(span.refusal(key, b) for b in betas):
                raise ElasticFlowError(f"optimizer.betas must be {span.describe()}, got {betas!r}", span.hint)
        elif key.startswith("optimizer.groups[]."):
            name = key.rpartition(".")[2]
            for i, group in enumerate(cfg.optimizer.groups):
                check(f"optimizer.groups[{i}].{name}", group[name], span)
        else:
            check(key, OmegaConf.select(cfg, key), span)
    o = cfg.optimizer
    if o.min_lr > o.lr:
        raise ElasticFlowError(f"optimizer.min_lr={o.min_lr:g} is more than optimizer.lr={o.lr:g}",
                               "the schedule decays from optimizer.lr down to optimizer.min_lr: lower "
                               "optimizer.min_lr, e.g. optimizer.min_lr=0")
    strings = {f"launcher.{k}": v for k, v in cfg.launcher.items() if k != "sbatch_args"}
    strings.update({f"launcher.sbatch_args[{i}]": v for i, v in enumerate(cfg.launcher.sbatch_args)})
    strings["model"] = OmegaConf.select(cfg, "model")  # its stem names the SLURM job in job.sbatch
    for key, value in strings.items():
        if isinstance(value, str) and has_control_characters(value):
            raise ElasticFlowError(f"{key} must be one line without control characters, got {value!r}",
                                   ONE_LINE_HINT)
    _check_sbatch_values(cfg.launcher)
    name = cfg.checkpoint.job_name
    if name is not None and (not name or any(part in name for part in ("/", "\\", "..")) or
                             has_control_characters(name)):
        raise ElasticFlowError(f"checkpoint.job_name must be a plain name (no '/', '\\', '..' or control "
                               f"characters), got {name!r}",
                               "it names the directory checkpoint.dir/<job_name>_<timestamp>/: pass e.g. "
                               "checkpoint.job_name=resnet-run2, and the location as checkpoint.dir")


SBATCH_VALUES = ("partition", "time", "account")  # written as `#SBATCH --<key>=<value>` (launchers/slurm_jobs.py)


def _check_sbatch_values(lc: Any) -> None:
    """sbatch splits a directive at spaces, and reads a leading dash as an option: ``partition='gpu --output=x
    --wrap=id'`` would pass options of its own. Each value is one word; each sbatch_args entry one option."""
    for key in SBATCH_VALUES:
        value = lc[key]
        if value is not None and (not str(value) or str(value).startswith("-") or
                                  any(c.isspace() for c in str(value))):
            raise ElasticFlowError(f"launcher.{key} must be one value without spaces or a leading dash, got "
                                   f"{str(value)!r}", f"pass e.g. launcher.{key}=gpu; other sbatch options go in "
                                   "launcher.sbatch_args, one per entry")
    for i, directive in enumerate(lc.sbatch_args):
        if not str(directive).startswith("-") or any(c.isspace() for c in str(directive)):
            raise ElasticFlowError(f"launcher.sbatch_args[{i}] must be one sbatch option without spaces, got "
                                   f"{str(directive)!r}", "one directive per entry: launcher.sbatch_args=[--qos=high]")


def has_control_characters(text: str) -> bool:
    """Whether ``text`` holds a control character: a newline, tab, escape, DEL, or one of C1's."""
    return any(unicodedata.category(c) == "Cc" for c in text)

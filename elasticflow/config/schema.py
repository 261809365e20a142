"""Structured-config schema of conf/: every key a user can set, typed and validated once.

Hydra merges conf/config.yaml and the chosen group files into :class:`Config`; an unknown key, a value
of the wrong type or a missing group choice fails before anything runs, as one line with a hint
(``composed``: Hydra's own messages span five to ten lines and suggest nothing).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from . import reproducible
from .ranges import check_ranges
from .devices import COMM_BACKENDS, DEVICES, PRECISIONS, precision_name
from ..errors import ElasticFlowError
from .launchers import check_kubernetes, check_nodes, check_store
from .spellings import spelling
from .topology import TopologyConfig, check_run, validate as validate_topology


@dataclass
class BackendConfig:
    name: str = "torch"            # torch | tensorflow
    jit: bool = True               # tensorflow: compile the step with tf.function (false to debug eagerly)
    # intra-op threads per worker; null = the cores it may use (CPU mask, cgroup quota) // local workers, less
    # data.workers with data.worker_type=process, and no more than other processes leave free (_util/affinity.py)
    threads: Optional[int] = None
    # CPU workers: each training thread on its own share of the host's cores when 2+ workers share it
    # (gloo's threads stay free; elasticflow/_util/affinity.py). Off when a launcher already placed the worker.
    pin_cores: bool = True


@dataclass
class EtcdConfig:
    """launcher.store=etcd: the job's records in an etcd cluster (docs/multi-host.md#no-single-point-of-failure)."""
    endpoints: List[str] = field(default_factory=list)  # every member's client URL, https://HOST:2379
    ca: Optional[str] = None       # the CA that signed the members' certificates
    cert: Optional[str] = None     # this job's client certificate (the members run --client-cert-auth) ...
    key: Optional[str] = None      # ... and its key, readable by you only
    lease_s: float = 3.0           # the agent's leadership lease: a standby takes over this long after it stops
    prefix: Optional[str] = None   # the job's keys' prefix (null = one drawn from the token and the run directory)
    # With etcd's authentication on (docs/multi-host.md#another-job-on-the-same-etcd):
    user: Optional[str] = None     # the etcd user the job logs in as (its role reaches launcher.etcd.prefix only)
    password_file: Optional[str] = None  # a file holding that user's password, readable by you only


@dataclass
class LauncherConfig:
    name: str = "local"            # local | nodes | slurm | kubernetes
    workers: int = 1               # local: worker processes; nodes: procs_per_node; slurm: nodes * tasks_per_node (set for you)
    min_workers: int = 1           # below this many for elastic.wait_s, the job checkpoints and stops
    max_workers: Optional[int] = None  # `elasticflow scale` limit (null = none); kubernetes: required, the most pods
    # local and nodes: each worker forked from one process that imported torch once (~2 s of CPU less per
    # worker start); false: each worker a fresh interpreter (launchers/zygote.py)
    fork_workers: bool = True
    restart_failed: bool = False   # replace a dead worker with a fresh one ...
    max_restarts: int = 3          # ... at most this many times per job
    # Several hosts (launcher=nodes): the same command on every host, torchrun-style (docs/multi-host.md)
    endpoint: Optional[str] = None  # HOST:PORT of the job's agent and store; the host owning HOST runs them
    procs_per_node: int = 1        # workers each host starts (and restarts)
    token_file: Optional[str] = None  # a file holding the job's shared secret (else $ELASTICFLOW_JOB_TOKEN)
    # The job's store (docs/security.md): auto = private on one host (a Unix socket only your processes can open),
    # token across hosts (a TCP port serving only connections that prove the job token); tcp = a plain TCPStore,
    # which anyone who reaches its port may connect to (trusted networks only)
    store: str = "auto"
    # etcd: the job's records in an etcd cluster, and the agent on every host, one leading and the others standing
    # by (a lost host loses no record, the agent's own included: docs/multi-host.md)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    # Refused otherwise: whoever can write there can swap what the workers read back, and run code as you.
    trust_shared_dirs: bool = False  # accept run, checkpoint, model folders (or ones above) others own or may write
    # SLURM (launcher=slurm): the allocation to ask for, and what to do at its end
    nodes: int = 1                 # slurm: nodes to ask for; nodes: hosts the first generation waits for
    # slurm: grow up to this many nodes, one single-node worker job per missing node, as SLURM frees them
    # (null = the allocation's nodes only; docs/slurm.md, "Growing into free nodes")
    max_nodes: Optional[int] = None
    tasks_per_node: int = 1        # workers per node
    partition: Optional[str] = None  # null = the cluster's default partition
    time: Optional[str] = None     # e.g. "02:00:00"
    cpus_per_task: Optional[int] = None  # cores per worker (null = SLURM's default); kubernetes: per worker pod
    gpus_per_node: Optional[int] = None  # GPUs per node, one per task (null = none); kubernetes: 1 per worker pod
    account: Optional[str] = None  # the account charged (null = your default)
    submit: bool = True            # false: write RUN_DIR/slurm/job.sbatch (or RUN_DIR/kubernetes/) without submitting
    signal: str = "USR1@90"        # warning signal before the time limit: checkpoint, then requeue
    requeue: bool = True           # after the warning signal, requeue the job to resume from its checkpoint
    interface: Optional[str] = None  # network interface (or address) the store and gloo listen on
    sbatch_args: List[str] = field(default_factory=list)  # extra `#SBATCH` lines, e.g. ["--qos=high"]
    # Kubernetes (launcher=kubernetes): the job's manifests in RUN_DIR/kubernetes/, applied unless submit=false;
    # min_workers core pods, up to max_workers as the cluster has room (docs/kubernetes.md)
    image: Optional[str] = None    # kubernetes: every pod's container image, with elasticflow installed (required)
    namespace: str = "default"     # kubernetes: the namespace of the job's objects
    job_name: Optional[str] = None  # kubernetes: the objects' names' prefix (null = elasticflow-<model file stem>)
    storage_class: Optional[str] = None  # kubernetes: the ReadWriteMany volume's storage class (null = the default)
    volume_size: str = "100Gi"     # kubernetes: the volume holding the run directory and checkpoints
    memory: Optional[str] = None   # kubernetes: each worker pod's memory, e.g. "16Gi" (null = none asked)
    port: int = 29400              # kubernetes: the port of the job's store on the agent pod (and its Service)
    core_priority: int = 1000      # kubernetes: PriorityClass value of the agent and the min_workers core pods
    elastic_priority: int = 100    # kubernetes: ... of the pods beyond min_workers, preempted first (lower)


@dataclass
class GroupConfig:
    params: List[str] = field(default_factory=list)  # name patterns: part of a name or module class, or a glob
    lr: Optional[float] = None            # null = optimizer.lr
    weight_decay: Optional[float] = None  # null = optimizer.weight_decay (0 where no_decay matches)


@dataclass
class OptimizerConfig:
    name: str = "sgd"              # sgd | adam | adamw
    lr: float = 0.1                # the peak learning rate (the schedule scales it)
    momentum: float = 0.0          # sgd
    nesterov: bool = False         # sgd with momentum
    weight_decay: float = 0.0      # sgd, adam: L2 added to the gradient; adamw: decoupled (as torch.optim)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # adam/adamw: moment decay rates
    eps: float = 1e-8              # adam/adamw: added to the denominator
    schedule: str = "constant"     # constant | linear | cosine | step
    warmup_steps: int = 0          # the learning rate rises linearly to lr over the first this many steps
    warmup_from_zero: bool = False  # step s of warmup at lr*s/warmup_steps (HF's; the first at 0), else lr*(s+1)/W
    decay_steps: Optional[int] = None  # linear/cosine: steps to reach min_lr (null = all training steps)
    min_lr: float = 0.0            # linear/cosine: the learning rate at the end of the decay
    step_size: int = 1000          # schedule=step: multiply by gamma every step_size steps
    gamma: float = 0.1             # schedule=step: the factor
    # parameters without weight decay, by name pattern (e.g. [bias,norm]: biases and normalization weights)
    no_decay: List[str] = field(default_factory=list)
    # parameter groups by name pattern, the first match wins: '[{params:[classifier],lr:1e-2}]'
    groups: List[GroupConfig] = field(default_factory=list)


@dataclass
class TrainerConfig:
    global_batch_size: int = 64             # samples per optimizer step, whatever the number of workers
    # samples per forward/backward (gradient accumulation); null = each worker's whole share at once, and then
    # BatchNorm's statistics and dropout masks depend on the number of workers (set it for exact elasticity)
    micro_batch_size: Optional[int] = None
    max_steps: Optional[int] = None          # stop after this many optimizer steps
    epochs: Optional[int] = None             # stop after this many epochs (null with max_steps null = 1)
    log_every: int = 10                      # steps between records in metrics.jsonl and the console
    eval_every: Optional[int] = None         # steps; null = evaluate once at the end (if eval_data exists)
    grad_clip: Optional[float] = None        # clip the global gradient norm to this value
    on_nonfinite: str = "stop"               # stop | skip: a step whose loss or summed gradient is NaN/inf
    drop_last: bool = False                  # true: skip an epoch's last, smaller global batch
    progress: Optional[bool] = None          # progress bar; null = only on a terminal
    device: str = "auto"                     # auto | cpu | cuda (auto: a GPU where the worker sees one)
    precision: str = "32"                    # 32 | bf16 | 16 (mixed: float32 weights; 16 adds loss scaling)
    data_on_device: Optional[bool] = None    # array datasets on the GPU; null = when they total <= 2 GiB
    # Where metrics and membership events go besides metrics.jsonl/events.jsonl, written by a sidecar process
    # of rank 0's: tensorboard (RUN_DIR/tensorboard/), csv (RUN_DIR/metrics.csv), mlflow, wandb (docs/observability.md)
    loggers: List[str] = field(default_factory=lambda: ["tensorboard"])  # any of tensorboard, csv, mlflow, wandb
    # seconds the run's end waits for the trackers to catch up; what is still behind then is caught up by the
    # next start of the run or `elasticflow sync RUN_DIR` (RUN_DIR/trackers-backlog.json lists it)
    loggers_wait_s: float = 60.0
    # none | optimizer (ZeRO stage 1: each worker keeps 1/W of the optimizer state) | gradients (stage 2:
    # the gradient is reduce-scattered too) | parameters (stage 3: and 1/W of the parameters, each submodule's
    # fetched for its forward and backward; torch, CPU). Elastic: see elastic.shard_replicas and docs/sharded-state.md.
    shard: str = "none"
    # trainer.shard=parameters: the submodules brought in one at a time, by qualified name pattern (fnmatch, e.g.
    # [transformer.h.*] for a Hugging Face GPT-2's blocks); [] = each top-level submodule (docs/sharded-state.md)
    shard_units: List[str] = field(default_factory=list)
    # the model a deterministic function of the config, the data and the seed, bit for bit, whatever the
    # number of workers and whoever died: exact sums, fixed threads, deterministic kernels (docs/exactness.md)
    reproducible: bool = False


@dataclass
class IntervalConfig:
    steps: Optional[int] = None    # save every this many optimizer steps (null = not by steps)
    epochs: Optional[int] = None   # save at the end of every this many epochs (null = not by epochs)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None      # null = RUN_DIR/checkpoints
    interval: IntervalConfig = field(default_factory=IntervalConfig)  # when to save, besides the end and Ctrl-C
    keep: Optional[int] = 3        # newest complete checkpoints kept (null = all)
    job_name: Optional[str] = None  # checkpoint.dir/<job_name>_<timestamp>/; null = the model file's stem
    # Write checkpoints in a background thread; training stalls only for an in-memory snapshot of this
    # worker's slice (false: each save returns once written and committed).
    async_save: bool = True
    # Best-k (Lightning's ModelCheckpoint): judged at each evaluation, kept beside the newest `keep`
    monitor: Optional[str] = None  # e.g. eval_loss, eval_accuracy, loss; null = no best-k checkpoints
    mode: str = "min"              # min | max: which way the monitored value is better
    save_top_k: int = 1            # checkpoints with the best monitored values kept


@dataclass
class ElasticConfig:
    heartbeat_timeout_s: float = 10.0  # a worker silent this long (stopped, hung) is killed by the agent
    timeout_s: float = 30.0        # a collective (and a group rendezvous) fails after this long
    wait_s: float = 60.0           # below launcher.min_workers, wait this long for workers, then stop
    # trainer.shard: every slice of the optimizer state is also held by the next rank (1), so a dead
    # worker's slice is restored from memory; 0: no copy (a lost slice falls back to the checkpoint)
    shard_replicas: int = 1
    # A worker slower than its peers (docs/elastic-training.md#stragglers): rebalance deals whole micro-batches
    # (trainer.micro_batch_size) in proportion to each member's measured speed, the same model either way;
    # evict also cuts out a worker straggler_factor x slower than the members' median for straggler_patience
    # steps in a row (a replacement starts where launcher.restart_failed); off deals equal shares
    straggler: str = "rebalance"   # rebalance | evict | off
    straggler_factor: float = 2.0  # this many times the median member's time per micro-batch is a straggler
    straggler_patience: int = 20   # steps in a row past the factor before the straggler event (and an eviction)
    # Compare the members' parameters every step (a checksum in the step's reduction): a member whose bits differ
    # from the majority's is cut out and the step redone; with no majority, back to the last agreed checkpoint
    fingerprint: bool = True
    # trainer.reproducible: every N steps one micro-batch is computed by two workers and their gradients compared
    # bit for bit (a device that computes wrongly, not only memory that flips: docs/elastic-training.md)
    verify_every: Optional[int] = None


@dataclass
class DataConfig:
    shuffle: bool = True           # each epoch a permutation of the samples, drawn from (seed, epoch); false: in order
    prefetch: int = 2              # micro-batches read ahead in the background (0: read when trained on)
    workers: int = 1               # readers at once: threads, or forked processes with worker_type=process
    worker_type: str = "thread"    # thread | process (CPU-heavy decoding in Python, out of the GIL's way)


@dataclass
class CommConfig:
    backend: str = "auto"          # auto | gloo | nccl (auto: NCCL where every worker has its own GPU)
    # Host gradients: reduce in buckets of this many MiB, each started while backward still runs (torch)
    # or all once the tape's gradient is complete (TensorFlow); null or 0: one reduction after backward.
    # Off by default: on 2 CPU cores gloo's transfer competes with backward for the cores, and one
    # reduction was as fast or faster on both backends (scripts/bench/bench_overlap.py; docs/benchmarks.md).
    bucket_mb: Optional[float] = None


@dataclass
class EarlyStoppingConfig:
    monitor: Optional[str] = None  # null = off; eval_* checked at each evaluation, a step metric (loss) at each step
    mode: str = "min"              # min | max: which way the monitored value is better
    patience: int = 3              # checks in a row without improvement before the run stops
    min_delta: float = 0.0         # a smaller change does not count as an improvement


@dataclass
class CallbacksConfig:
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)  # stop when a metric stalls
    lr_monitor: bool = False       # add each parameter group's learning rate (lr_group<i>) to the step records
    # your own: [{_target_: mypackage.callbacks.MyCallback, arg: 1}], built on every worker (docs/callbacks.md)
    extra: List[Any] = field(default_factory=list)


@dataclass
class Config:
    model: str = MISSING           # path to the model file (set by `elasticflow train PATH`)
    backend: BackendConfig = field(default_factory=BackendConfig)  # the framework (a group: backend=tensorflow)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # where workers run (a group: launcher=slurm)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # a group: optimizer=adamw
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the loop: batch, length, logging, precision
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saves and resume
    elastic: ElasticConfig = field(default_factory=ElasticConfig)  # failure detection and recovery
    comm: CommConfig = field(default_factory=CommConfig)  # the gradient reduction
    data: DataConfig = field(default_factory=DataConfig)  # reading data() ahead of training
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)  # early stopping, your own hooks
    # how the workers are connected: the graph of roles and channels (a group: topology=hierarchical)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    seed: int = 0                  # parameters (via cfg.seed), sample order, dropout
    resume: str = "auto"           # auto | none | PATH to a checkpoint directory
    # the run's result a sweeper optimizes (-m hydra/sweeper=optuna): null = eval_loss, or loss without eval_data()
    objective: Optional[str] = None
    # Free-form section for the model file's own settings (model(cfg) / data(cfg) read cfg.model_args).
    model_args: Any = field(default_factory=dict)


# Old key -> new key. An override of an old key fails naming the new one, not with Hydra's "Key not in".
# (checkpoint.async: a Python keyword cannot be a dataclass field.)
RENAMED = {"checkpoint.async": "checkpoint.async_save"}
REPLACED = {"trainer.tensorboard": "trainer.loggers=[tensorboard] writes RUN_DIR/tensorboard/, trainer.loggers=[] "
                                   "no tracker at all (trainer.loggers also takes csv, mlflow, wandb)"}

BACKENDS = ("torch", "tensorflow")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "linear", "cosine", "step")
WORKER_TYPES = ("thread", "process")
STRAGGLER_ACTIONS = ("rebalance", "evict", "off")
SHARD_STAGES = ("none", "optimizer", "gradients", "parameters")
LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")  # observability/trackers.py


def register() -> None:
    """Put the schema in Hydra's ConfigStore as ``base_config`` (conf/config.yaml extends it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


def refuse_renamed(overrides: List[str]) -> None:
    """Raise ElasticFlowError for an override (``key=v``, ``+key=v``, ``++key=v``) of a renamed key."""
    for override in overrides:
        key, has_value, value = override.lstrip("~+").partition("=")
        if key in RENAMED:
            new = RENAMED[key]
            raise ElasticFlowError(f"{key} was renamed to {new}",
                                   f"pass {new}={value}" if has_value else f"use {new} instead")
        if key in REPLACED:
            raise ElasticFlowError(f"{key} was replaced by trainer.loggers", REPLACED[key])


def _choice(value: Any, choices: tuple, key: str, hint: str) -> None:
    if str(value) not in choices:
        raise ElasticFlowError(f"{key} must be one of {', '.join(choices)}, got {value!r}", hint)


def validate(cfg: Any) -> None:
    """Check the values Hydra's types cannot: ranges (config/ranges.py), string choices, and keys against
    each other. Raises ElasticFlowError."""
    check_ranges(cfg)
    t = cfg.trainer
    if t.on_nonfinite not in ("stop", "skip"):
        raise ElasticFlowError(f"trainer.on_nonfinite must be 'stop' or 'skip', got {t.on_nonfinite!r}",
                               "set trainer.on_nonfinite=skip to skip steps whose loss or gradient is NaN or inf")
    for name in t.loggers:
        _choice(name, LOGGERS, "trainer.loggers", "name any of them, e.g. trainer.loggers=[tensorboard,mlflow], "
                "or trainer.loggers=[] for none")
    _choice(t.shard, SHARD_STAGES, "trainer.shard",
            "pass trainer.shard=optimizer (ZeRO stage 1), gradients (stage 2), parameters (stage 3) or none "
            "(replicated state)")
    if t.shard == "parameters" and cfg.backend.name != "torch":
        raise ElasticFlowError(f"trainer.shard=parameters is built for backend=torch, not {cfg.backend.name} (it "
                               "brings parameters in per submodule with torch's module and autograd hooks)",
                               "pass trainer.shard=gradients (stage 2) on TensorFlow")
    _choice(t.device, DEVICES, "trainer.device", "pass trainer.device=auto (a GPU where there is one) or cpu")
    _choice(precision_name(t.precision), PRECISIONS, "trainer.precision",
            "pass trainer.precision=bf16 for mixed precision (16: float16 with loss scaling, 32: none)")
    _choice(cfg.comm.backend, COMM_BACKENDS, "comm.backend", "pass comm.backend=auto")
    for key, value in (("checkpoint.mode", cfg.checkpoint.mode),
                       ("callbacks.early_stopping.mode", cfg.callbacks.early_stopping.mode)):
        _choice(value, ("min", "max"), key, f"pass {key}=min (lower is better, as a loss) or max")
    if cfg.backend.name not in BACKENDS:
        raise ElasticFlowError(f"unknown backend {cfg.backend.name!r}; expected one of {', '.join(BACKENDS)}",
                               "pass backend=torch or backend=tensorflow")
    o = cfg.optimizer
    if o.name not in OPTIMIZERS:
        raise ElasticFlowError(f"unknown optimizer {o.name!r}; expected one of {', '.join(OPTIMIZERS)}",
                               "pass optimizer=sgd, optimizer=adam or optimizer=adamw")
    if o.schedule not in SCHEDULES:
        raise ElasticFlowError(f"unknown optimizer.schedule {o.schedule!r}; expected one of {', '.join(SCHEDULES)}",
                               "pass e.g. optimizer.schedule=cosine")
    lc = cfg.launcher
    if lc.name not in ("local", "nodes", "slurm", "kubernetes"):
        raise ElasticFlowError(f"unknown launcher {lc.name!r}",
                               "pass launcher=local, launcher=nodes, launcher=slurm or launcher=kubernetes")
    check_store(lc)
    if lc.name == "nodes":
        check_nodes(lc)
    if lc.name == "kubernetes":
        check_kubernetes(cfg)
    if lc.name == "slurm":
        if not re.fullmatch(r"[A-Z0-9]+@\d+", lc.signal):
            raise ElasticFlowError(f"launcher.signal={lc.signal!r} is not SIGNAL@SECONDS",
                                   "pass e.g. launcher.signal=USR1@90")
        # Each worker's srun step binds one GPU of its own (launchers/slurm.py srun_launch).
        gpus = lc.gpus_per_node
        if gpus is None and t.device == "cuda":
            raise ElasticFlowError("trainer.device=cuda with launcher=slurm but launcher.gpus_per_node is not set, "
                                   "so the job would be given no GPU",
                                   "pass launcher.gpus_per_node=N (N GPUs on each node, one per task)")
        if gpus is not None and lc.tasks_per_node > gpus:
            # Refused for every comm.backend, not only nccl: each step asks for a GPU of its own, so the
            # steps beyond the node's GPUs would wait in srun ("Requested nodes are busy") until one frees.
            why = ("NCCL cannot put two workers on one GPU" if cfg.comm.backend == "nccl" else
                   f"each worker's srun step takes a GPU of its own, so {lc.tasks_per_node - gpus} per node would wait")
            raise ElasticFlowError(f"launcher.tasks_per_node={lc.tasks_per_node} is more than "
                                   f"launcher.gpus_per_node={gpus}: {why}",
                                   f"pass launcher.tasks_per_node={gpus}, or launcher.gpus_per_node={lc.tasks_per_node}")
    if lc.max_nodes is not None and (lc.name != "slurm" or lc.max_nodes < lc.nodes):
        raise ElasticFlowError(f"launcher.max_nodes={lc.max_nodes} " + (
            f"is less than launcher.nodes={lc.nodes}" if lc.name == "slurm" else "is for launcher=slurm only"),
            "pass launcher.max_nodes >= launcher.nodes, or null to use the allocation only" if lc.name == "slurm"
            else "leave launcher.max_nodes null, or use launcher=slurm")
    if lc.max_workers is not None and lc.max_workers < lc.workers and lc.name == "local":
        raise ElasticFlowError(f"launcher.max_workers={lc.max_workers} is less than launcher.workers={lc.workers}",
                               "raise launcher.max_workers, or leave it null for no limit")
    workers = {"slurm": lc.nodes * lc.tasks_per_node, "nodes": lc.nodes * lc.procs_per_node,
               "kubernetes": lc.max_workers}.get(lc.name, lc.workers)
    if lc.min_workers > workers:
        raise ElasticFlowError(f"launcher.min_workers={lc.min_workers} is more than the {workers} workers asked for",
                               "lower launcher.min_workers or ask for more workers")
    el = cfg.elastic
    if not (0 < el.heartbeat_timeout_s < el.timeout_s):
        raise ElasticFlowError(
            f"elastic.heartbeat_timeout_s={el.heartbeat_timeout_s:g} must be positive and shorter than "
            f"elastic.timeout_s={el.timeout_s:g}",
            "the agent must cut a hung worker out before its peers' collectives time out, e.g. "
            "elastic.heartbeat_timeout_s=10 elastic.timeout_s=30")
    _choice(el.straggler, STRAGGLER_ACTIONS, "elastic.straggler",
            "pass elastic.straggler=rebalance (shares by speed), evict (also cut a straggler out) or off")
    _choice(cfg.data.worker_type, WORKER_TYPES, "data.worker_type",
            "pass data.worker_type=process for CPU-heavy decoding in Python, else thread")
    iv = cfg.checkpoint.interval
    if iv.steps is not None and iv.epochs is not None:
        raise ElasticFlowError("checkpoint.interval.steps and checkpoint.interval.epochs are both set",
                               "set only one of them (the other to null)")
    kind = validate_topology(cfg.topology).kind
    check_run(cfg, kind)
    reproducible.check(cfg, kind)


def compose(model: str, overrides: Optional[List[str]] = None) -> Any:
    """Build a validated config without the CLI, e.g. for ``ElasticTrainer`` in your own loop.

    Example:
        >>> cfg = compose("models/digits_mlp.py", ["trainer.global_batch_size=32", "optimizer=adam"])
    """
    refuse_renamed(overrides or [])
    cfg = composed([f"model={model}", *(overrides or [])])
    validate(cfg)
    return cfg


def composed(overrides: List[str]) -> Any:
    """conf/ composed with ``overrides`` by Hydra (not validated). A Hydra error becomes one
    ElasticFlowError: the key, what is wrong with it, and a hint (the closest keys or the choices)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException

    from .._util.paths import conf_dir

    register()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose("config", overrides=overrides)
    except HydraException as exc:
        raise _explained(exc) from exc
    _refuse_added(cfg)
    return cfg


def _refuse_added(cfg: Any) -> None:
    """Refuse a key that ``+key=value`` added outside ``model_args``: nothing would ever read it (a typo of a
    real key, e.g. ``+trainer.max_stepz=3``, would silently leave the default in force)."""
    from omegaconf import DictConfig, OmegaConf

    def walk(node: Any, schema: Any, prefix: str) -> None:
        known = [str(k) for k in schema.keys()]  # not `in schema`: it is False for a MISSING value (model)
        for key in node:
            if str(key) not in known:
                raise ElasticFlowError(f"unknown config key {prefix}{key} (added with +)",
                                       spelling(str(key)) or _did_you_mean(str(key), known, prefix)
                                       + "+ adds keys only under model_args, the model file's own settings")
            child, shape = node[key], OmegaConf.select(schema, str(key))
            if key != "model_args" and isinstance(child, DictConfig) and isinstance(shape, DictConfig):
                walk(child, shape, f"{prefix}{key}.")

    walk(cfg, OmegaConf.structured(Config), "")


def _did_you_mean(key: str, known: List[str], prefix: str) -> str:
    """The start of a hint naming the keys of ``known`` closest to ``key`` (each under ``prefix``), e.g.
    ``did you mean trainer.max_steps? ``; empty when none is close."""
    import difflib

    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    return f"did you mean {' or '.join(prefix + k for k in close)}? " if close else ""


def _explained(exc: Exception) -> ElasticFlowError:
    """Hydra's composition error ``exc`` as one line and a hint."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause, first = exc.__cause__, (str(exc).splitlines() or [type(exc).__name__])[0]
    listing = "`elasticflow train MODEL.py --cfg job` prints every key with its value"
    if isinstance(exc, MissingConfigException) and exc.options:
        group, _, choice = (exc.missing_cfg_file or "").rpartition("/")
        return ElasticFlowError(f"{group}={choice} is not a choice of the config group {group}",
                                f"use one of: {', '.join(f'{group}={o}' for o in exc.options)}")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        parent, _, key = cause.full_key.rpartition(".")
        if parent == "model_args":  # the model file's free-form section starts empty: keys are added
            return ElasticFlowError(f"unknown config key {cause.full_key}",
                                    f"model_args holds the model file's own settings: add one with "
                                    f"+{cause.full_key}=VALUE")
        known = [str(k) for k in cause.parent_node] if cause.parent_node is not None else []
        return ElasticFlowError(f"unknown config key {cause.full_key}",
                                spelling(key) or _did_you_mean(key, known, f"{parent}." if parent else "") + listing)
    if isinstance(cause, ValidationError) and cause.full_key:
        return ElasticFlowError(f"{cause.full_key}: {str(cause).splitlines()[0]}",
                                f"pass a value of the key's type; {listing}")
    if isinstance(exc, OverrideParseException):
        return ElasticFlowError(f"cannot parse an override: {first}",
                                "overrides are key=value; quote a value with spaces, commas or brackets, "
                                "e.g. 'trainer.name=a b'")
    if first.startswith("Ambiguous value"):
        return ElasticFlowError(first, "a list is key=[a,b]; a string with commas is key='a,b'; to sweep "
                                       "over the values add -m")
    return ElasticFlowError(f"config: {first}", "run with --debug for Hydra's full message")

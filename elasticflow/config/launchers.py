"""The launchers' keys checked against each other: launcher=nodes (an endpoint every host names alike) and
launcher=kubernetes (what the manifests need, refused before anything is written). Called by
``schema.validate``."""
from __future__ import annotations

import re
from typing import Any

from ..errors import ElasticFlowError


def _positive_int(value: Any, key: str, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ElasticFlowError(f"{key} must be a positive integer, got {value!r}", hint)


STORES = ("auto", "private", "token", "tcp", "etcd")


def check_store(lc: Any) -> None:
    """launcher.store: one of STORES; a private store serves one host only."""
    if lc.store not in STORES:
        raise ElasticFlowError(f"launcher.store must be one of {', '.join(STORES)}, got {lc.store!r}",
                               "pass launcher.store=auto (private on one host, token across hosts)")
    if lc.store == "private" and lc.name != "local":
        raise ElasticFlowError(f"launcher.store=private serves one host, but launcher={lc.name} spans hosts",
                               "pass launcher.store=token (or auto): a TCP port that serves only the job's "
                               "token holders (docs/security.md)")
    if lc.store == "etcd":
        check_etcd(lc)


def check_etcd(lc: Any) -> None:
    """launcher.store=etcd: launcher=nodes, every member's https URL, the TLS files named."""
    hint = ("pass launcher.etcd.endpoints=[https://10.0.0.1:2379,...] launcher.etcd.ca=... launcher.etcd.cert=... "
            "launcher.etcd.key=... (docs/multi-host.md#no-single-point-of-failure)")
    if lc.name != "nodes":
        raise ElasticFlowError(f"launcher.store=etcd runs with launcher=nodes, not launcher={lc.name}",
                               "pass launcher=nodes, the same command on every host")
    e = lc.etcd
    if not e.endpoints or not all(isinstance(u, str) and u.startswith("https://") for u in e.endpoints):
        raise ElasticFlowError(f"launcher.etcd.endpoints must list every etcd member's https:// client URL, got "
                               f"{list(e.endpoints)!r}", hint)
    for what in ("ca", "cert", "key"):  # read where the job starts (launchers/failover.py): a host may lack them
        if not getattr(e, what):
            raise ElasticFlowError(f"launcher.etcd.{what} is not set (the members ask every client for a "
                                   "certificate, and the client checks theirs against the CA)", hint)


def store_kind(lc: Any) -> str:
    """The store the agent serves (distributed/store/stores.py): ``auto`` is private for launcher=local, else token."""
    if lc.store == "auto":
        return "private" if lc.name == "local" else "token"
    return lc.store


def check_nodes(lc: Any) -> None:
    """launcher=nodes: an endpoint every host names the same way, and how many workers per host."""
    hint = "pass launcher.endpoint=HOST:PORT, the address and a free port of the host that runs the agent"
    if not lc.endpoint and lc.store != "etcd":
        raise ElasticFlowError("launcher=nodes needs launcher.endpoint, the job's meeting point", hint)
    host, _, port = str(lc.endpoint).rpartition(":")
    if lc.endpoint and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise ElasticFlowError(f"launcher.endpoint={lc.endpoint!r} is not HOST:PORT", hint)
    _positive_int(lc.procs_per_node, "launcher.procs_per_node", "pass e.g. launcher.procs_per_node=2")
    _positive_int(lc.nodes, "launcher.nodes", "pass the number of hosts to wait for at the start, e.g. launcher.nodes=2")
    lc.workers = lc.procs_per_node


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")  # a Kubernetes memory or storage size
JOB_NAME_MAX = 40  # the objects' names add suffixes (-elastic, and a pod's index and random tail) within 63


def check_kubernetes(cfg: Any) -> None:
    """launcher=kubernetes: what the manifests need, refused here so that nothing is written for a bad value."""
    lc = cfg.launcher
    if lc.max_workers is None:
        raise ElasticFlowError("launcher=kubernetes needs launcher.max_workers, the most worker pods the job grows to",
                               "pass e.g. launcher.max_workers=8 launcher.min_workers=2 (the pods it starts with)")
    if lc.max_workers < lc.min_workers:
        raise ElasticFlowError(f"launcher.max_workers={lc.max_workers} is less than launcher.min_workers="
                               f"{lc.min_workers}", f"pass launcher.max_workers >= {lc.min_workers}, or lower "
                                                    "launcher.min_workers")
    if not lc.image or not lc.image.strip() or any(c.isspace() for c in lc.image):
        raise ElasticFlowError(f"launcher=kubernetes needs launcher.image, the pods' container image, got {lc.image!r}",
                               "pass an image with elasticflow and your model's packages installed, e.g. "
                               "launcher.image=registry.example.com/team/elasticflow:0.1")
    for key, value, limit in (("job_name", lc.job_name, JOB_NAME_MAX), ("namespace", lc.namespace, 63)):
        if value is not None and not (DNS_LABEL.fullmatch(value) and len(value) <= limit):
            raise ElasticFlowError(f"launcher.{key}={value!r} is not a valid Kubernetes name: lowercase letters, "
                                   f"digits and '-', starting and ending with a letter or digit, at most {limit} "
                                   "characters (a DNS-1123 label)", f"pass e.g. launcher.{key}=resnet-run2")
    if lc.storage_class is not None and not all(DNS_LABEL.fullmatch(p) for p in lc.storage_class.split(".")):
        raise ElasticFlowError(f"launcher.storage_class={lc.storage_class!r} is not a valid Kubernetes name",
                               "pass a class `kubectl get storageclass` lists, or null for the cluster's default")
    for key, value in (("volume_size", lc.volume_size), ("memory", lc.memory)):
        if value is not None and not QUANTITY.fullmatch(str(value)):
            raise ElasticFlowError(f"launcher.{key}={value!r} is not a Kubernetes quantity",
                                   f"pass e.g. launcher.{key}=16Gi")
    if lc.gpus_per_node not in (None, 1):
        raise ElasticFlowError(f"launcher.gpus_per_node={lc.gpus_per_node} with launcher=kubernetes: each worker pod "
                               "runs one worker, on one GPU", "pass launcher.gpus_per_node=1, or null for no GPU")
    if lc.gpus_per_node is None and cfg.trainer.device == "cuda":
        raise ElasticFlowError("trainer.device=cuda with launcher=kubernetes but launcher.gpus_per_node is not set, so "
                               "the worker pods would be given no GPU", "pass launcher.gpus_per_node=1")
    if lc.elastic_priority >= lc.core_priority:
        raise ElasticFlowError(f"launcher.elastic_priority={lc.elastic_priority} is not below launcher.core_priority="
                               f"{lc.core_priority}: the pods beyond min_workers must be the first preempted",
                               "pass e.g. launcher.core_priority=1000 launcher.elastic_priority=100")
    if cfg.checkpoint.dir is not None:
        raise ElasticFlowError(f"checkpoint.dir={cfg.checkpoint.dir!r} with launcher=kubernetes: the pods share only "
                               "the job's volume, where the checkpoints go (RUN_DIR/checkpoints)",
                               "leave checkpoint.dir null")

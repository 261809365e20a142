"""launcher=kubernetes: write the job's manifests to RUN_DIR/kubernetes/ and apply them; scale a running job.

    elasticflow train model.py launcher=kubernetes launcher.image=REGISTRY/IMAGE:TAG launcher.min_workers=2 \
        launcher.max_workers=8

The agent runs in a pod of its own behind a Service; min_workers worker pods at a higher priority, and up to
max_workers - min_workers more at a lower one, join it as the scheduler places them (kubernetes_manifests.py
has the objects and why each is there, kubernetes_pod.py what runs in the pods). With launcher.submit=false
the manifests are only written (`kubectl apply -f RUN_DIR/kubernetes/` applies them in order).

The official client (`pip install kubernetes`) is imported only to submit or scale, and reads the usual
kubeconfig ($KUBECONFIG, ~/.kube/config) or, inside a pod, the service account's.
"""
from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml

from ..distributed import protocol
from ..errors import ElasticFlowError
from .kubernetes_manifests import build, names

log = logging.getLogger("elasticflow")
RECORD = ".elasticflow/kubernetes.json"  # what `elasticflow scale` needs: the namespace, the Jobs, the bounds
REQUEST_S = 30  # a bound on each API call: an address that swallows packets must not hang the command
# How each kind is created: the API class, its create method, whether it takes the namespace.
CREATE = {"PriorityClass": ("SchedulingV1Api", "create_priority_class", False),
          "NetworkPolicy": ("NetworkingV1Api", "create_namespaced_network_policy", True),
          "PersistentVolumeClaim": ("CoreV1Api", "create_namespaced_persistent_volume_claim", True),
          "Secret": ("CoreV1Api", "create_namespaced_secret", True),
          "ConfigMap": ("CoreV1Api", "create_namespaced_config_map", True),
          "Service": ("CoreV1Api", "create_namespaced_service", True),
          "Job": ("BatchV1Api", "create_namespaced_job", True)}
# Kept when they exist already: a class's name holds its value and policy, so an existing one is the same; an
# existing volume is this job's from an earlier submission, with its checkpoints (resume=auto continues there).
KEPT = {"PriorityClass", "PersistentVolumeClaim"}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's files) as literal blocks: the file reads as the file."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def write(objects: List[Tuple[str, Dict[str, Any]]], folder: Path) -> List[Path]:
    """One YAML file per object, numbered in creation order (`kubectl apply -f` takes a folder's files in
    name order). The Secret's file is readable by the owner only."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (stem, obj) in enumerate(objects):
        path = folder / f"{i:02d}-{stem}.yaml"
        text = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
        if obj["kind"] == "Secret":
            protocol.write_private(path, text)
        else:
            path.write_text(text)
        paths.append(path)
    return paths


def run(cfg: Any, run_dir: Path) -> Dict[str, Any]:
    """Write RUN_DIR/kubernetes/ (cfg arrives validated: config._check_kubernetes); apply it unless
    launcher.submit=false."""
    lc, n = cfg.launcher, names(cfg)
    submission = secrets.token_hex(4)  # this submission's id: the pods' marker of the agent's end carries it
    objects = build(cfg, secrets.token_hex(32), submission)  # raises before anything is written
    folder = run_dir / "kubernetes"
    write(objects, folder)
    elastic = n["elastic"] if lc.max_workers > lc.min_workers else None  # no elastic Job when they are equal
    record = {"namespace": lc.namespace, "job": n["job"], "elastic_job": elastic, "min_workers": lc.min_workers,
              "max_workers": lc.max_workers, "submission": submission}
    protocol.write_private(run_dir / RECORD, json.dumps(record))
    summary = {"job": n["job"], "namespace": lc.namespace, "run_dir": str(run_dir)}
    if not lc.submit:
        print(f"wrote {len(objects)} manifests to {folder}; submit them with: kubectl apply -f {folder}", flush=True)
        return summary
    k8s = client(f"apply the manifests with: kubectl apply -f {folder}")
    apply(k8s, objects, folder)
    print(f"submitted job {n['job']} to namespace {lc.namespace}: {lc.min_workers} worker pod(s) to start, up to "
          f"{lc.max_workers} as the cluster has room; follow it with: kubectl logs -f job/{n['agent']}", flush=True)
    return summary


def client(fallback: str):
    """The ``kubernetes`` package with a configuration loaded (kubeconfig, else in-cluster); one line if
    either is missing. ``fallback``: how to do without (the hint)."""
    try:
        import kubernetes
    except ImportError:
        raise ElasticFlowError("talking to Kubernetes needs the Python package kubernetes, which is not installed",
                               f"pip install kubernetes, or {fallback}") from None
    # urllib3 warns of each retry on its own line; the one line below says it once.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    try:
        kubernetes.config.load_kube_config()
    except Exception as exc:  # noqa: BLE001 - ConfigException, or a malformed file: the same one line
        try:
            kubernetes.config.load_incluster_config()
        except Exception:  # noqa: BLE001
            raise ElasticFlowError(f"no Kubernetes configuration found ({_first_line(exc)})",
                                   f"point $KUBECONFIG at your cluster's kubeconfig (kubectl must work), or "
                                   f"{fallback}") from None
    return kubernetes


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _refusal(exc: BaseException) -> str:
    """An ApiException as 'STATUS Reason: the server's message'."""
    message = ""
    try:
        message = json.loads(getattr(exc, "body", "") or "{}").get("message", "")
    except (ValueError, AttributeError):
        pass
    return f"{exc.status} {getattr(exc, 'reason', '')}" + (f": {message}" if message else "")


class ApiRefused(ElasticFlowError):
    """The API server answered with an error; ``status`` is its HTTP status (409: the object exists)."""
    status = 0


def _call(what: str, fn, *args, hint: str):
    """``fn(*args)`` against the API server; its refusal (ApiRefused) or unreachability as one line."""
    try:
        return fn(*args, _request_timeout=REQUEST_S)
    except Exception as exc:  # noqa: BLE001 - ApiException has .status; anything else: the server not reached
        if getattr(exc, "status", None) is not None:
            refused = ApiRefused(f"the Kubernetes API refused to {what}: {_refusal(exc)}", hint)
            refused.status = exc.status
            raise refused from None
        reason = getattr(exc, "reason", None) or exc  # urllib3's MaxRetryError: the last attempt's error
        raise ElasticFlowError(f"cannot reach the Kubernetes API server to {what} ({_first_line(reason)})",
                               "check that `kubectl get pods` works from here (the kubeconfig's server and "
                               "credentials)") from None


def apply(k8s, objects: List[Tuple[str, Dict[str, Any]]], folder: Path) -> None:
    """Create every object in order. One that exists already stops the submission (KEPT kinds excepted)."""
    apis: Dict[str, Any] = {}
    for _, obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        api_class, method, namespaced = CREATE[kind]
        api = apis.setdefault(api_class, getattr(k8s.client, api_class)())
        args = (obj["metadata"]["namespace"], obj) if namespaced else (obj,)
        try:
            _call(f"create {kind} {name}", getattr(api, method), *args,
                  hint=f"`kubectl delete -f {folder}` removes what was created; fix the cause and run again")
        except ApiRefused as exc:
            if exc.status != 409:
                raise
            if kind in KEPT:
                log.info("%s %s exists already: kept", kind, name)
                continue
            raise ElasticFlowError(exc.message, f"an earlier job holds the name: `kubectl delete -f {folder}` deletes "
                                                "this job's objects, or pass launcher.job_name=ANOTHER") from None
        log.info("created %s %s", kind, name)


def is_kubernetes_run(run_dir: Path) -> bool:
    return (Path(run_dir) / RECORD).is_file()


def scale_body(extra: int) -> Dict[str, Any]:
    """The patch that runs ``extra`` elastic pods. An elastic Indexed Job changes completions only together
    with an equal parallelism; none at all is parallelism 0 alone (completions 0 would break its success
    policy's succeededCount 1), which leaves completions as they were until the next scale up."""
    return {"spec": {"parallelism": extra, "completions": extra}} if extra else {"spec": {"parallelism": 0}}


def scale(run_dir: Path, workers: int) -> str:
    """Patch the elastic Job of the Kubernetes run in ``run_dir`` to ``workers`` - min_workers pods."""
    record = json.loads((Path(run_dir) / RECORD).read_text())
    low, high = record["min_workers"], record["max_workers"]
    if not low <= workers <= high:
        raise ElasticFlowError(f"cannot scale job {record['job']} to {workers} workers: it runs launcher.min_workers="
                               f"{low} to launcher.max_workers={high}", f"pass --workers between {low} and {high}")
    if record["elastic_job"] is None:
        return f"job {record['job']} has no elastic pods (launcher.min_workers = launcher.max_workers): nothing to do"
    k8s = client(f"patch the Job by hand: kubectl patch job {record['elastic_job']} -n {record['namespace']} ...")
    extra = workers - low
    _call(f"patch Job {record['elastic_job']}", k8s.client.BatchV1Api().patch_namespaced_job, record["elastic_job"],
          record["namespace"], scale_body(extra), hint="is the job still there? kubectl get jobs -n "
                                                       f"{record['namespace']}")
    return (f"job {record['job']}: {workers} workers asked ({low} core + {extra} elastic pods); new pods join as the "
            "scheduler places them, removed ones leave at once")

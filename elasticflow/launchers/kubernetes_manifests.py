"""The objects of a launcher=kubernetes job, as plain dicts in Kubernetes' own schema (kubernetes.py writes and
applies them; docs/kubernetes.md says what each is for).

    PriorityClass x2   elasticflow-core-<value>, elasticflow-elastic-<value>: cluster-wide, shared by every job
                       with the same values (a class's name holds its value, so one that exists is the same)
    NetworkPolicy      only the job's own pods reach its pods (the store, gloo): the trust boundary
    PersistentVolumeClaim  ReadWriteMany: the run directory and the checkpoints, at VOLUME_PATH in every pod
    Secret             the job token, as $ELASTICFLOW_JOB_TOKEN in every pod
    ConfigMap          config.yaml and the model file (with the modules it imports from its own folder), at
                       FILES_PATH: a stock image with elasticflow installed runs the job
    Service            <job>-agent: the store's stable address
    Job <job>-agent    one pod: the agent (membership, the store); a Job, not a bare Pod, so that a lost node
                       or an eviction brings a new agent, which resumes from the checkpoint on the volume
    Job <job>-core     Indexed, launcher.min_workers pods at the core priority
    Job <job>-elastic  Indexed, max_workers - min_workers pods at the lower elastic priority: preempted first,
                       and they preempt nothing (they wait for free room). Two Jobs because one Job's pods
                       share one priority. `elasticflow scale` patches its parallelism and completions.

Each worker pod runs one worker under a node agent (distributed/agent/node_agent.py), which joins it to the job
when the scheduler places the pod: the job starts with what fits and grows as room frees up.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

from omegaconf import OmegaConf

from ..distributed import protocol
from ..errors import ElasticFlowError

VOLUME_PATH = "/mnt/elasticflow"  # the job's volume in every pod: the run directory
FILES_PATH = "/etc/elasticflow"   # the ConfigMap in every pod: config.yaml and the model file
POD_MODULE = "elasticflow.launchers.kubernetes_pod"
ENV_POD_IP = "POD_IP"
ENV_NODE_NAME = "ELASTICFLOW_NODE_NAME"  # the node agent's name in the job: the pod's name
JOB_LABEL, ROLE_LABEL = "elasticflow/job", "elasticflow/role"
# Exit codes after which a retry cannot help (an ElasticFlowError: the config, the model file, the volume):
# the pod failure policy fails the Job at once instead of spending backoffLimit on them.
FAIL_JOB_EXITS = [2]
# A worker pod's exits when the job stopped around it, its checkpoint written (too few workers, the agent
# lost, the agent's own SIGTERM): no fault of the pod's, so not counted; its replacement joins the next agent.
# Counted, one eviction of the agent pod would spend a Job's backoffLimit once per worker pod.
STOPPED_EXITS = [protocol.EXIT_BELOW_MIN, protocol.EXIT_AGENT_LOST, protocol.EXIT_INTERRUPTED]
CONFIGMAP_MAX_BYTES = 1024 * 1024  # the API server's limit on one object
FILE_KEY = re.compile(r"[-._a-zA-Z0-9]+")  # what a ConfigMap key may hold


def default_name(model: str) -> str:
    """elasticflow-<the model file's stem>, made a DNS-1123 label (lowercase, '-' for anything else)."""
    stem = re.sub(r"[^a-z0-9]+", "-", Path(model).stem.lower()).strip("-")
    return f"elasticflow-{stem}"[:40].rstrip("-")


def names(cfg: Any) -> Dict[str, str]:
    lc = cfg.launcher
    job = lc.job_name or default_name(cfg.model)
    return {"job": job, "agent": f"{job}-agent", "core": f"{job}-core", "elastic": f"{job}-elastic",
            "token": f"{job}-token", "files": f"{job}-files", "volume": f"{job}-run",
            "core_class": f"elasticflow-core-{lc.core_priority}",
            "elastic_class": f"elasticflow-elastic-{lc.elastic_priority}",
            "endpoint": f"{job}-agent.{lc.namespace}.svc:{lc.port}"}


def shipped_files(model: str) -> Dict[str, str]:
    """The model file and the modules it imports from its own folder (``import _digits`` beside it), by name.

    Only plain top-level imports of a sibling ``NAME.py`` are followed (recursively); anything else the model
    needs (packages, data files) must be in the image or on the volume.
    """
    first = Path(model)
    found: Dict[str, str] = {}
    todo = [first]
    while todo:
        path = todo.pop()
        if path.name in found:
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ElasticFlowError(f"cannot ship {path} to the pods ({exc})",
                                   "the model file and the modules beside it that it imports must be UTF-8 text")
        if not FILE_KEY.fullmatch(path.name):
            raise ElasticFlowError(f"the file name {path.name!r} cannot be a ConfigMap key",
                                   "rename it with letters, digits, '-', '_' and '.' only")
        found[path.name] = text
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError as exc:
            raise ElasticFlowError(f"{path}:{exc.lineno}: {exc.msg}", "fix the model file before shipping it")
        for node in ast.walk(tree):
            tops = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            siblings = [first.parent / f"{t.split('.')[0]}.py" for t in tops]
            todo += [s for s in siblings if s.is_file()]
    return found


def _labels(cfg: Any, role: str = "") -> Dict[str, str]:
    labels = {"app.kubernetes.io/name": "elasticflow", JOB_LABEL: names(cfg)["job"]}
    return {**labels, ROLE_LABEL: role} if role else labels


def _meta(name: str, cfg: Any, role: str = "", namespaced: bool = True) -> Dict[str, Any]:
    meta = {"name": name, "labels": _labels(cfg, role)}
    return {**meta, "namespace": cfg.launcher.namespace} if namespaced else meta


def _pod(cfg: Any, role: str, command: List[str], resources: Dict[str, Any], priority_class: str) -> Dict[str, Any]:
    """A pod template: the container, the token, the pod's address and name, the volume and the files."""
    n = names(cfg)
    env = [{"name": protocol.ENV_JOB_TOKEN, "valueFrom": {"secretKeyRef": {"name": n["token"], "key": "token"}}},
           {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    container = {"name": "agent" if role == "agent" else "worker", "image": cfg.launcher.image, "command": command,
                 "env": env, "resources": resources,
                 "volumeMounts": [{"name": "run", "mountPath": VOLUME_PATH},
                                  {"name": "files", "mountPath": FILES_PATH, "readOnly": True}]}
    if role == "agent":  # Ready (in the Service) once the store listens
        container["ports"] = [{"name": "store", "containerPort": cfg.launcher.port, "protocol": "TCP"}]
        container["readinessProbe"] = {"tcpSocket": {"port": cfg.launcher.port}, "periodSeconds": 2}
    spec = {"restartPolicy": "Never",  # a replacement is a new pod, a new joiner: the Job makes it
            "priorityClassName": priority_class, "containers": [container],
            "volumes": [{"name": "run", "persistentVolumeClaim": {"claimName": n["volume"]}},
                        {"name": "files", "configMap": {"name": n["files"]}}]}
    return {"metadata": {"labels": _labels(cfg, role)}, "spec": spec}


def _job(cfg: Any, name: str, role: str, pods: int, pod: Dict[str, Any]) -> Dict[str, Any]:
    container = pod["spec"]["containers"][0]["name"]
    spec = {"parallelism": pods, "completions": pods, "backoffLimit": cfg.launcher.max_restarts,
            # A pod the cluster took away (preemption, eviction, a drained node) is no failure of the job: its
            # replacement waits for room and joins. Exit 2 is a mistake no retry mends.
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In",
                                                      "values": FAIL_JOB_EXITS}}]},
            "template": pod}
    if role != "agent":
        spec["podFailurePolicy"]["rules"].append({"action": "Ignore", "onExitCodes": {
            "containerName": container, "operator": "In", "values": STOPPED_EXITS}})
        # Indexed: completions can be patched with parallelism (elastic Indexed Jobs), and the first pod
        # whose worker finished training completes the Job, removing its pods still waiting for room.
        spec["completionMode"] = "Indexed"
        spec["successPolicy"] = {"rules": [{"succeededCount": 1}]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(name, cfg, role), "spec": spec}


def _worker_resources(lc: Any) -> Dict[str, Any]:
    requests: Dict[str, str] = {}
    limits: Dict[str, Any] = {}
    if lc.cpus_per_task:
        requests["cpu"] = str(lc.cpus_per_task)  # a request, no limit: a CPU limit throttles the collectives
    if lc.memory:
        requests["memory"] = limits["memory"] = str(lc.memory)
    if lc.gpus_per_node:
        limits["nvidia.com/gpu"] = "1"
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def config_text(cfg: Any, model_name: str) -> str:
    """The resolved config the pods run, its model path the file's place in the pods."""
    data = OmegaConf.to_container(cfg, resolve=True)
    data["model"] = f"{FILES_PATH}/{model_name}"
    return OmegaConf.to_yaml(OmegaConf.create(data))


def build(cfg: Any, token: str, submission: str) -> List[Tuple[str, Dict[str, Any]]]:
    """(file name, object) of every object of the job, in the order they are created. Raises ElasticFlowError
    (before anything is written) for a model file that cannot be shipped."""
    lc, n = cfg.launcher, names(cfg)
    files = shipped_files(cfg.model)
    files["config.yaml"] = config_text(cfg, Path(cfg.model).name)
    size = sum(len(k) + len(v.encode()) for k, v in files.items())
    if size > CONFIGMAP_MAX_BYTES - 4096:  # room for the object's metadata
        raise ElasticFlowError(f"the model file, the modules beside it and the config take {size} bytes, more than "
                               "a ConfigMap holds (1 MiB)", "put large code in the image and import it from there")
    common = ["python", "-m", POD_MODULE]
    places = ["--run-dir", VOLUME_PATH, "--files", FILES_PATH, "--submission", submission]
    agent_pod = _pod(cfg, "agent", [*common, "agent", *places, "--port", str(lc.port)],
                     {"requests": {"cpu": "250m", "memory": "512Mi"}}, n["core_class"])
    worker_cmd = [*common, "worker", *places, "--endpoint", n["endpoint"]]
    out = [
        ("priorityclass-core", {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                "metadata": _meta(n["core_class"], cfg, namespaced=False),
                                "value": lc.core_priority, "globalDefault": False,
                                "preemptionPolicy": "PreemptLowerPriority",
                                "description": "ElasticFlow: job agents and the workers a job needs (min_workers)"}),
    ]
    if lc.max_workers > lc.min_workers:
        out.append(("priorityclass-elastic", {
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": _meta(n["elastic_class"], cfg, namespaced=False), "value": lc.elastic_priority,
            "globalDefault": False, "preemptionPolicy": "Never",
            "description": "ElasticFlow: workers beyond a job's min_workers; preempted first, they preempt nothing"}))
    selector = {"matchLabels": {JOB_LABEL: n["job"]}}
    out += [
        ("networkpolicy", {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                           "metadata": _meta(n["job"], cfg),
                           "spec": {"podSelector": selector, "policyTypes": ["Ingress"],
                                    "ingress": [{"from": [{"podSelector": selector}]}]}}),
        ("persistentvolumeclaim", {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                   "metadata": _meta(n["volume"], cfg),
                                   "spec": {"accessModes": ["ReadWriteMany"],
                                            "resources": {"requests": {"storage": str(lc.volume_size)}},
                                            **({"storageClassName": lc.storage_class} if lc.storage_class else {})}}),
        ("secret", {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(n["token"], cfg), "type": "Opaque",
                    "stringData": {"token": token}}),
        ("configmap", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(n["files"], cfg), "data": files}),
        ("service", {"apiVersion": "v1", "kind": "Service", "metadata": _meta(n["agent"], cfg, "agent"),
                     "spec": {"selector": {JOB_LABEL: n["job"], ROLE_LABEL: "agent"},
                              "ports": [{"name": "store", "port": lc.port, "targetPort": lc.port,
                                         "protocol": "TCP"}]}}),
        ("job-agent", _job(cfg, n["agent"], "agent", 1, agent_pod)),
        ("job-core", _job(cfg, n["core"], "core", lc.min_workers,
                          _pod(cfg, "core", worker_cmd, _worker_resources(lc), n["core_class"]))),
    ]
    if lc.max_workers > lc.min_workers:
        out.append(("job-elastic", _job(cfg, n["elastic"], "elastic", lc.max_workers - lc.min_workers,
                                        _pod(cfg, "elastic", worker_cmd, _worker_resources(lc), n["elastic_class"]))))
    return out

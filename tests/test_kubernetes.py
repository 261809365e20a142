"""launcher=kubernetes without a cluster: no API server runs here.

The manifests `elasticflow train ... launcher=kubernetes` writes are validated offline against Kubernetes'
own schemas (kubernetes-validate, strict: an unknown field fails), the client calls of submit and scale are
checked against a fake client, and the pods' commands -- taken from the written manifests, with the Secret's
token, the downward API's address and name, the volumes and the Service's name replaced by local ones -- run
as local processes on loopback: the job trains to the 1-worker result, losing a pod to SIGTERM on the way.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from harness import COMMON, PROBE, REPO, assert_equivalent, cli, run_cli, wait_for, world_sizes

from elasticflow.config.schema import compose
from elasticflow.errors import ElasticFlowError
from elasticflow.launchers import kubernetes as k8s

validate_schema = pytest.importorskip("kubernetes_validate.utils", reason="the dev extra is not installed "
                                      "(pip install -e '.[dev]' brings kubernetes-validate)")

# 1.33: the oldest release where every field used is stable (Job successPolicy went GA in 1.33; elastic
# Indexed Jobs and podFailurePolicy in 1.31). 1.37: the newest schema kubernetes-validate 1.37.0 ships.
VERSIONS = ("1.33.0", "1.37.0")
IMAGE = "registry.example.com/team/elasticflow:0.1"
BASE = ["launcher=kubernetes", f"launcher.image={IMAGE}", "launcher.min_workers=2", "launcher.max_workers=3"]


def write_manifests(run: Path, *overrides: str) -> dict:
    """`elasticflow train PROBE launcher=kubernetes launcher.submit=false ...`; the objects by file stem."""
    run_cli(["train", PROBE, f"hydra.run.dir={run}", *COMMON, *BASE, "launcher.submit=false", *overrides],
            timeout=120, check=True)
    return read(run / "kubernetes")


def read(folder: Path) -> dict:
    return {p.stem.split("-", 1)[1]: yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml"))}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    run = tmp_path_factory.mktemp("manifests")
    return run, write_manifests(run, "launcher.cpus_per_task=2", "launcher.memory=8Gi", "launcher.gpus_per_node=1",
                                "launcher.storage_class=nfs-client", "launcher.namespace=research")


# ---------------------------------------------------------------- 1. the schema, offline
KINDS = ["priorityclass-core", "priorityclass-elastic", "networkpolicy", "persistentvolumeclaim", "secret",
         "configmap", "service", "job-agent", "job-core", "job-elastic"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("stem", KINDS)
def test_each_manifest_is_valid_against_the_kubernetes_schema(written, stem, version):
    _, objects = written
    assert validate_schema.validate(objects[stem], version, strict=True) == version.rsplit(".", 1)[0]


def test_strict_validation_refuses_an_unknown_field(written):
    """The check above can fail: a field Kubernetes does not know (a typo) is refused."""
    job = json.loads(json.dumps(written[1]["job-elastic"]))
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # resources, misspelt
    with pytest.raises(validate_schema.ValidationError, match="resource"):
        validate_schema.validate(job, VERSIONS[0], strict=True)


def test_the_objects_say_what_the_job_needs(written):
    run, o = written
    core, elastic, agent = o["job-core"]["spec"], o["job-elastic"]["spec"], o["job-agent"]["spec"]
    assert (core["parallelism"], core["completions"], elastic["parallelism"], elastic["completions"]) == (2, 2, 1, 1)
    assert core["completionMode"] == elastic["completionMode"] == "Indexed"
    for spec in (core, elastic, agent):
        pod = spec["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert spec["podFailurePolicy"]["rules"][0] == {
            "action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts == {"run": "/mnt/elasticflow", "files": "/etc/elasticflow"}  # the same path in every pod
        env = {e["name"]: e.get("valueFrom") for e in pod["containers"][0]["env"]}
        assert env["ELASTICFLOW_JOB_TOKEN"] == {"secretKeyRef": {"name": o["secret"]["metadata"]["name"],
                                                                 "key": "token"}}
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == o["persistentvolumeclaim"]["metadata"]["name"]
    # A worker pod that stopped because the job stopped around it (checkpoint written) is no failure of its own.
    stopped = {"action": "Ignore", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [3, 4, 130]}}
    assert stopped in core["podFailurePolicy"]["rules"] and stopped in elastic["podFailurePolicy"]["rules"]
    assert [r["action"] for r in agent["podFailurePolicy"]["rules"]] == ["Ignore", "FailJob"]
    # The pods beyond min_workers are preempted first, and preempt nothing themselves.
    classes = {o[k]["metadata"]["name"]: o[k] for k in ("priorityclass-core", "priorityclass-elastic")}
    core_class = classes[core["template"]["spec"]["priorityClassName"]]
    elastic_class = classes[elastic["template"]["spec"]["priorityClassName"]]
    assert agent["template"]["spec"]["priorityClassName"] == core["template"]["spec"]["priorityClassName"]
    assert elastic_class["value"] < core_class["value"] and elastic_class["preemptionPolicy"] == "Never"
    assert core["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}}
    pvc = o["persistentvolumeclaim"]["spec"]
    assert pvc["accessModes"] == ["ReadWriteMany"] and pvc["storageClassName"] == "nfs-client"
    assert {o[k]["metadata"].get("namespace") for k in KINDS if "priorityclass" not in k} == {"research"}
    # The Service finds the agent pod, and the workers name the Service.
    service = o["service"]
    assert service["spec"]["selector"].items() <= agent["template"]["metadata"]["labels"].items()
    assert f"{service['metadata']['name']}.research.svc:29400" in core["template"]["spec"]["containers"][0]["command"]
    # A new random token, in a file only its owner reads; the files the pods run.
    token = o["secret"]["stringData"]["token"]
    assert len(token) == 64 and int(token, 16) >= 0
    secret_file = next((run / "kubernetes").glob("*-secret.yaml"))
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    data = o["configmap"]["data"]
    assert set(data) == {"config.yaml", "digits_probe.py"} and data["digits_probe.py"] == PROBE.read_text()
    assert yaml.safe_load(data["config.yaml"])["model"] == "/etc/elasticflow/digits_probe.py"


def test_a_model_file_ships_with_the_modules_it_imports_beside_it(tmp_path):
    o = write_manifests(tmp_path / "run", f"model={REPO / 'models' / 'digits_mlp.py'}", "launcher.max_workers=2")
    assert set(o["configmap"]["data"]) == {"config.yaml", "digits_mlp.py", "_digits.py"}
    assert "job-elastic" not in o and "priorityclass-elastic" not in o  # max_workers = min_workers: no elastic pods


# ---------------------------------------------------------------- 2. refusals before anything is written
@pytest.mark.parametrize("overrides, message", [
    (["launcher.max_workers=0"], "error: launcher.max_workers must be a positive integer, got 0"),
    (["launcher.max_workers=-4"], "error: launcher.max_workers must be a positive integer, got -4"),
    (["launcher.max_workers=null"], "error: launcher=kubernetes needs launcher.max_workers"),
    (["launcher.min_workers=4"], "error: launcher.max_workers=3 is less than launcher.min_workers=4"),
    (["launcher.job_name=Resnet_Run"], "error: launcher.job_name='Resnet_Run' is not a valid Kubernetes name"),
    (["launcher.job_name=" + "a" * 41], "is not a valid Kubernetes name"),
    (["launcher.image=null"], "error: launcher=kubernetes needs launcher.image"),
    (["launcher.volume_size=lots"], "error: launcher.volume_size='lots' is not a Kubernetes quantity"),
])
def test_invalid_settings_are_refused_before_any_manifest_is_written(tmp_path, overrides, message):
    run = tmp_path / "run"
    proc = cli(["train", PROBE, f"hydra.run.dir={run}", *BASE, *overrides])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and message in lines[0] and lines[1].startswith("hint: "), proc.stderr
    assert not (run / "kubernetes").exists()


# ---------------------------------------------------------------- 3. submitting
def test_submit_without_a_kubeconfig_is_one_line(tmp_path):
    run = tmp_path / "run"
    env = {"KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    # A subprocess: the kubernetes package reads $KUBECONFIG once, when it is imported.
    proc = run_cli(["train", PROBE, f"hydra.run.dir={run}", *BASE], timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[0].startswith("error: no Kubernetes configuration found"), proc.stderr
    assert proc.stderr.splitlines()[1].startswith("hint: point $KUBECONFIG at your cluster's kubeconfig")
    assert len(proc.stderr.strip().splitlines()) == 2 and len(list((run / "kubernetes").glob("*.yaml"))) == 10


def test_submit_to_an_api_server_that_does_not_answer_is_one_line(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": f"https://127.0.0.1:{port}",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    proc = run_cli(["train", PROBE, f"hydra.run.dir={tmp_path / 'run'}", *BASE], timeout=120,
                   env={"KUBECONFIG": str(kubeconfig)})  # a subprocess: the package reads $KUBECONFIG at import
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: cannot reach the Kubernetes API server to create "
                                                   "PriorityClass elasticflow-core-1000"), proc.stderr


class ApiException(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"({status}) Reason: {reason}")
        self.status, self.reason, self.body = status, reason, json.dumps({"message": message})


def fake_kubernetes(calls: list, refuse: dict | None = None):
    """A stand-in for the ``kubernetes`` package: each API call is recorded as (class, method, args); the
    ones in ``refuse`` ({(method, name): status}) raise ApiException."""
    def api(cls: str):
        class Api:
            def __getattr__(self, method):
                def call(*args, **kwargs):
                    assert kwargs == {"_request_timeout": k8s.REQUEST_S}
                    calls.append((cls, method, args))
                    body = args[-1]
                    name = args[0] if method.startswith("patch") else body["metadata"]["name"]
                    if (method, name) in (refuse or {}):
                        raise ApiException(refuse[method, name], "Conflict", f"{name} already exists")
                return call
        return Api

    client = types.SimpleNamespace(**{c: api(c) for c in ("CoreV1Api", "BatchV1Api", "SchedulingV1Api",
                                                           "NetworkingV1Api")})
    config = types.SimpleNamespace(load_kube_config=lambda: None, load_incluster_config=lambda: None)
    return types.SimpleNamespace(client=client, config=config)


def test_submit_creates_every_object_in_order(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setitem(sys.modules, "kubernetes", fake_kubernetes(calls))
    cfg = compose(str(PROBE), [*BASE, "launcher.namespace=research"])
    assert k8s.run(cfg, tmp_path) == {"job": "elasticflow-digits-probe", "namespace": "research",
                                      "run_dir": str(tmp_path)}
    written = read(tmp_path / "kubernetes")
    assert [(c, m) for c, m, _ in calls] == [
        ("SchedulingV1Api", "create_priority_class"), ("SchedulingV1Api", "create_priority_class"),
        ("NetworkingV1Api", "create_namespaced_network_policy"),
        ("CoreV1Api", "create_namespaced_persistent_volume_claim"), ("CoreV1Api", "create_namespaced_secret"),
        ("CoreV1Api", "create_namespaced_config_map"), ("CoreV1Api", "create_namespaced_service"),
        ("BatchV1Api", "create_namespaced_job"), ("BatchV1Api", "create_namespaced_job"),
        ("BatchV1Api", "create_namespaced_job")]
    assert [args[-1] for _, _, args in calls] == list(written.values())  # what was written is what was sent
    assert all(args[0] == "research" for _, m, args in calls if "namespaced" in m)
    assert [args[-1]["metadata"]["name"] for _, m, args in calls if m == "create_namespaced_job"] == [
        "elasticflow-digits-probe-agent", "elasticflow-digits-probe-core", "elasticflow-digits-probe-elastic"]
    assert "submitted job elasticflow-digits-probe to namespace research" in capsys.readouterr().out


def test_an_existing_volume_is_kept_and_an_existing_job_stops_the_submission(tmp_path, monkeypatch):
    calls = []
    refuse = {("create_namespaced_persistent_volume_claim", "elasticflow-digits-probe-run"): 409,
              ("create_priority_class", "elasticflow-core-1000"): 409,
              ("create_namespaced_job", "elasticflow-digits-probe-agent"): 409}
    monkeypatch.setitem(sys.modules, "kubernetes", fake_kubernetes(calls, refuse))
    with pytest.raises(ElasticFlowError) as info:
        k8s.run(compose(str(PROBE), BASE), tmp_path)
    assert info.value.message == ("the Kubernetes API refused to create Job elasticflow-digits-probe-agent: "
                                  "409 Conflict: elasticflow-digits-probe-agent already exists")
    assert "launcher.job_name=ANOTHER" in info.value.hint
    assert [m for _, m, _ in calls][-1] == "create_namespaced_job" and len(calls) == 8  # went on past the 409s


def test_without_the_kubernetes_package_one_line_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` raises ImportError
    with pytest.raises(ElasticFlowError) as info:
        k8s.run(compose(str(PROBE), BASE), tmp_path)
    assert info.value.message == "talking to Kubernetes needs the Python package kubernetes, which is not installed"
    assert info.value.hint.startswith("pip install kubernetes, or apply the manifests with: kubectl apply -f ")


# ---------------------------------------------------------------- 4. scale
def test_scale_patches_the_elastic_job(tmp_path, monkeypatch):
    cfg = compose(str(PROBE), [*BASE, "launcher.max_workers=6", "launcher.namespace=research", "launcher.submit=false"])
    k8s.run(cfg, tmp_path)
    calls = []
    monkeypatch.setitem(sys.modules, "kubernetes", fake_kubernetes(calls))
    assert k8s.scale(tmp_path, 5).startswith("job elasticflow-digits-probe: 5 workers asked (2 core + 3 elastic pods)")
    k8s.scale(tmp_path, 2)
    assert calls == [
        ("BatchV1Api", "patch_namespaced_job", ("elasticflow-digits-probe-elastic", "research",
                                                {"spec": {"parallelism": 3, "completions": 3}})),
        ("BatchV1Api", "patch_namespaced_job", ("elasticflow-digits-probe-elastic", "research",
                                                {"spec": {"parallelism": 0}}))]


def test_scale_outside_min_and_max_workers_is_refused_in_one_line(tmp_path):
    k8s.run(compose(str(PROBE), [*BASE, "launcher.submit=false"]), tmp_path)
    for workers in (1, 4):
        proc = cli(["scale", tmp_path, "--workers", workers])
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [
            f"error: cannot scale job elasticflow-digits-probe to {workers} workers: it runs launcher.min_workers=2 "
            "to launcher.max_workers=3", "hint: pass --workers between 2 and 3"]


# ---------------------------------------------------------------- 5. the pods' commands, as local processes
class Pods:
    """The containers of the written Jobs run here: the Secret's token, 127.0.0.1 for the pod's address and
    the Service's name, a folder for each volume (the ConfigMap's files written into one), the pod's name."""

    def __init__(self, objects: dict, tmp: Path, env: dict):
        self.objects, self.env, self.procs, self.logs = objects, env, {}, tmp / "pod-logs"
        self.volume, self.files = tmp / "volume", tmp / "files"
        self.logs.mkdir()
        self.volume.mkdir()
        self.files.mkdir()
        for name, text in objects["configmap"]["data"].items():
            (self.files / name).write_text(text)
        service = objects["service"]["metadata"]
        self.service = f"{service['name']}.{service['namespace']}.svc"

    def start(self, job: str, pod: str) -> subprocess.Popen:
        spec = self.objects[job]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        volumes = {v["name"]: v for v in spec["volumes"]}
        places = {m["mountPath"]: self.files if "configMap" in volumes[m["name"]] else self.volume
                  for m in container["volumeMounts"]}

        def here(word: str) -> str:
            for path, folder in places.items():
                word = word.replace(path, str(folder))
            return word.replace(self.service, "127.0.0.1")

        env = {}
        for e in container["env"]:
            source = e.get("valueFrom", {})
            if "secretKeyRef" in source:
                assert source["secretKeyRef"]["name"] == self.objects["secret"]["metadata"]["name"]
                env[e["name"]] = self.objects["secret"]["stringData"][source["secretKeyRef"]["key"]]
            elif "fieldRef" in source:
                env[e["name"]] = {"status.podIP": "127.0.0.1", "metadata.name": pod}[source["fieldRef"]["fieldPath"]]
            else:
                env[e["name"]] = e["value"]
        argv = [sys.executable if w == "python" else here(w) for w in container["command"]]
        # The image's Python finds the probe's own imports (models/digits_mlp.py) on its path.
        full_env = {**os.environ, "PYTHONPATH": str(REPO / "models"), **self.env, **env}
        log = open(self.logs / f"{pod}.log", "w")
        self.procs[pod] = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=self.logs)
        return self.procs[pod]

    def wait(self, pod: str, timeout: float) -> int:
        try:
            return self.procs[pod].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pod {pod} did not end in {timeout}s:\n{self.log(pod)[-3000:]}") from None

    def log(self, pod: str) -> str:
        return (self.logs / f"{pod}.log").read_text()

    def stop_all(self) -> None:
        for proc in self.procs.values():  # SIGTERM first: a worker pod's handler kills its worker
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_the_pods_commands_train_to_the_one_worker_result_and_survive_a_sigterm(tmp_path, reference):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    objects = write_manifests(tmp_path / "run", f"launcher.port={port}")
    pace = tmp_path / "pace"  # steps take EF_PROBE_SLEEP while it exists: room to see 3 workers, then kill one
    pace.touch()
    pods = Pods(objects, tmp_path, {"EF_PROBE_SLEEP": "0.3", "EF_PROBE_PACE": str(pace)})
    try:
        pods.start("job-agent", "agent")
        for pod in ("core-0", "core-1", "elastic-0"):
            pods.start(f"job-{pod.split('-')[0]}", pod)
        wait_for(lambda: 3 in world_sizes(pods.volume), 90, "the elastic pod's worker in the job")
        pods.procs["elastic-0"].send_signal(signal.SIGTERM)  # what Kubernetes sends a preempted pod
        assert pods.wait("elastic-0", 10) == 128 + signal.SIGTERM
        wait_for(lambda: world_sizes(pods.volume)[-1] == 2, 90, "a step without the pod")
        pace.unlink()
        assert pods.wait("agent", 120) == 0, pods.log("agent")[-3000:]
        for pod in ("core-0", "core-1"):
            assert pods.wait(pod, 30) == 0, pods.log(pod)[-3000:]
            assert f"done: host={pod} workers=1" in pods.log(pod)
        assert "done:" in pods.log("agent")
        assert world_sizes(pods.volume)[-1] == 2  # the job went on without the pod
        assert_equivalent(pods.volume, reference)
        # A pod placed after the end (its Job's success policy would have removed it): out at once, not waiting.
        late = pods.start("job-elastic", "elastic-1")
        assert late.wait(60) == 0 and "the job had finished" in pods.log("elastic-1")
    finally:
        pods.stop_all()


def test_a_replaced_agent_pod_resumes_the_job(tmp_path, reference):
    """SIGTERM to the agent pod (an eviction): the workers checkpoint and stop. Replacement worker pods wait for
    the agent Job's new pod, which resumes from the checkpoint on the volume to the 1-worker result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    objects = write_manifests(tmp_path / "run", f"launcher.port={port}", "launcher.max_workers=2")
    pace = tmp_path / "pace"
    pace.touch()
    pods = Pods(objects, tmp_path, {"EF_PROBE_SLEEP": "0.3", "EF_PROBE_PACE": str(pace)})
    try:
        for job, pod in (("job-agent", "agent"), ("job-core", "core-0"), ("job-core", "core-1")):
            pods.start(job, pod)
        wait_for(lambda: len(world_sizes(pods.volume)) >= 10, 90, "step 10")
        pods.procs["agent"].send_signal(signal.SIGTERM)
        assert [pods.wait(pod, 60) for pod in ("agent", "core-0", "core-1")] == [130] * 3
        assert "interrupted: checkpoint written" in pods.log("agent")
        for pod in ("core-2", "core-3"):  # the Job's replacements, placed before the new agent pod
            pods.start("job-core", pod)
        for pod in ("core-2", "core-3"):  # waiting for the agent, not failing
            wait_for(lambda: "waiting for the job's agent" in pods.log(pod), 60, f"{pod} to wait for the agent")
            assert pods.procs[pod].poll() is None, pods.log(pod)
        pace.unlink()
        pods.start("job-agent", "agent-2")
        assert [pods.wait(pod, 120) for pod in ("agent-2", "core-2", "core-3")] == [0] * 3, pods.log("agent-2")[-3000:]
        assert_equivalent(pods.volume, reference)
    finally:
        pods.stop_all()

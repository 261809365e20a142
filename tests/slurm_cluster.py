"""A real SLURM cluster on this machine for tests: the session fixture `slurm_cluster`.

`scripts/ops/slurm-local.sh start` runs once per test session (installing SLURM from apt if needed, about 25 s the
first time, then about 1 s to idle nodes) and `stop` at the end, unless the cluster was already up before the
session, in which case it is left running. Where SLURM cannot be started (not root, no apt, a start that fails)
every test using the fixture is skipped with the reason, the script's own error included; set
SLURM_LOCAL_REQUIRED=1 (e.g. in CI) to make that an error instead.

Use it from a test module with

    from slurm_cluster import slurm_cluster, slurm  # noqa: F401  (fixtures)

`slurm_cluster` is session-scoped; `slurm` is the same object for one test and cancels every job still queued or
running when the test ends. The cluster has SLURM_LOCAL_NODES nodes (default 2 here; all run on this machine,
see the script) with SLURM_LOCAL_CPUS CPUs each (default 8), one partition `debug`. There is no accounting
database, so no `sacct`: `job_info` (scontrol, kept for 1 h after a job ends) and `jobcomp` (the job completion
log) stand in for it.

Several hosts: `slurm_hosts_cluster` (session) and `slurm_hosts` (per test) are a second cluster, of
HOSTS namespace hosts h1, h2 (`SLURM_LOCAL_HOSTS=2 scripts/ops/slurm-local.sh start`: each host has its own
network, hostname, processes, munged and slurmd; slurmctld runs on h1). It has its own state directory and
namespaces (prefix efs, subnet 10.232.0), so it runs beside `slurm_cluster`. A `SlurmHosts` runs every
client command on h1, the cluster's login node (`run`, `sbatch`, ... as above; `on(host, *argv)` is the
argv that runs a command on a host, e.g. `elasticflow train`), and loses a node with `power_off("h2")`:
every process of the host (slurmd, munged, job steps, workers) is SIGKILLed at once, and slurmctld marks the
node DOWN about 6 s later (SlurmdTimeout 4 s, MessageTimeout 2 s). `slurm_hosts` powers lost hosts on
again and restarts their daemons when the test ends, so every test starts with all nodes idle.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ops" / "slurm-local.sh"
HOSTS_SH = REPO / "scripts" / "ops" / "hosts.sh"
DEFAULT_NODES = "2"
HOSTS = 2
# The hosts cluster's own namespaces and state: other tests' hosts use hosts.sh's defaults (ef, 10.231.0).
# Short timeouts: a powered-off node is DOWN in ~6 s rather than ~30 s (a ping of a dead node takes about
# MessageTimeout to fail, and it takes two).
HOSTS_ENV = {"SLURM_LOCAL_HOSTS": str(HOSTS), "EF_HOSTS_PREFIX": "efs", "EF_HOSTS_SUBNET": "10.232.0",
             "SLURM_LOCAL_DIR": "/var/lib/slurm-local-hosts", "SLURM_LOCAL_SLURMD_TIMEOUT": "4",
             "SLURM_LOCAL_MESSAGE_TIMEOUT": "2"}

# Job states after which a job does not run again by itself (a requeued job goes back to PENDING instead).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"})

_KV = re.compile(r"(\S+?)=(.*?)(?=\s+\S+?=|$)")


def _parse(line: str) -> Dict[str, str]:
    """'Key=Value Key=Value ...' (scontrol -o, the job completion log) as a dict."""
    return {k: v.strip() for k, v in _KV.findall(line.strip())}


class SlurmError(RuntimeError):
    pass


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """os.environ without SLURM_*/SBATCH_*/SALLOC_*/SRUN_* (say pytest itself runs inside an allocation), plus
    EXTRA."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
    env.update(extra or {})
    return env


class SlurmCluster:
    """Helpers around the SLURM command-line tools of the local cluster."""

    def __init__(self, script: Path = SCRIPT, log_dir: Optional[Path] = None):
        self.script = script
        base = Path(os.environ.get("SLURM_LOCAL_DIR", "/var/lib/slurm-local"))
        self.log_dir = log_dir or base / "log"

    # -- running commands ---------------------------------------------------------------------------------
    def run(self, *args: Union[str, Path], timeout: float = 60, check: bool = True, cwd: Optional[Path] = None,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        """Run a command (e.g. "squeue", "-h") with a clean SLURM environment; text output."""
        proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=clean_env(env), stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        return proc

    @property
    def nodes(self) -> List[str]:
        """Node names, in order."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N").stdout.split()
        return sorted(set(out), key=lambda n: (len(n), n))

    # -- submitting ---------------------------------------------------------------------------------------
    def sbatch(self, script: Union[str, Path], *args: str, cwd: Optional[Path] = None,
               env: Optional[Dict[str, str]] = None) -> int:
        """Submit a batch script (a path, or the script's text) with extra sbatch ARGS; returns the job id.
        ENV adds variables to the submitting environment (sbatch exports it all to the job by default)."""
        path = Path(script) if not (isinstance(script, str) and "\n" in script) else None
        if path is None:
            fd, name = tempfile.mkstemp(prefix="sbatch-", suffix=".sh", dir=cwd)
            with os.fdopen(fd, "w") as f:
                f.write(script)
            path = Path(name)
        out = self.run("sbatch", "--parsable", *args, path, cwd=cwd, env=env).stdout.strip()
        return int(out.split(";")[0].split("+")[0])

    def sbatch_wrap(self, command: str, *args: str, cwd: Optional[Path] = None,
                    env: Optional[Dict[str, str]] = None) -> int:
        """`sbatch --wrap COMMAND ARGS`; returns the job id."""
        out = self.run("sbatch", "--parsable", *args, "--wrap", command, cwd=cwd, env=env).stdout.strip()
        return int(out.split(";")[0])

    def submit_and_wait(self, script: Union[str, Path], *args: str, state: Union[str, Iterable[str]] = "RUNNING",
                        timeout: float = 60, cwd: Optional[Path] = None,
                        env: Optional[Dict[str, str]] = None) -> int:
        """sbatch SCRIPT, then wait until the job is in STATE (one or several); returns the job id."""
        jobid = self.sbatch(script, *args, cwd=cwd, env=env)
        self.wait_state(jobid, state, timeout=timeout)
        return jobid

    # -- querying -----------------------------------------------------------------------------------------
    def job_info(self, jobid: int) -> Dict[str, str]:
        """`scontrol show job -o JOBID` as a dict (JobState, Reason, ExitCode, Restarts, NodeList, StdOut, ...);
        for a heterogeneous job, its first component. {} if SLURM does not know the job (any more)."""
        proc = self.run("scontrol", "show", "job", "-o", str(jobid), check=False)
        line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
        return _parse(line)

    def state(self, jobid: int) -> str:
        """The job's state (PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, ...), "" if unknown."""
        return self.job_info(jobid).get("JobState", "")

    def squeue(self, *args: str, fmt: str = "%i %T %r") -> List[List[str]]:
        """`squeue -h -o FMT ARGS` split into fields per line, e.g. squeue("-j", "3") -> [["3", "RUNNING", "None"]]."""
        return [line.split() for line in self.run("squeue", "-h", "-o", fmt, *args).stdout.splitlines()
                if line.strip()]

    def steps(self, jobid: int) -> List[str]:
        """Ids of the job's steps that run now ("12.batch", "12.0", ...)."""
        return [row[0] for row in self.squeue("-s", "-j", str(jobid), fmt="%i")]

    def jobcomp(self, jobid: int) -> Dict[str, str]:
        """The job completion log's record of the job's last end (JobState, ExitCode, StartTime, EndTime,
        NodeList, ...): SLURM writes one each time the job ends, requeues included. {} if none yet."""
        path = self.log_dir / "jobcomp.log"
        records = [_parse(line) for line in path.read_text().splitlines()] if path.exists() else []
        mine = [r for r in records if r.get("JobId") == str(jobid)]
        return mine[-1] if mine else {}

    def sacct(self, *args: str) -> subprocess.CompletedProcess:
        raise SlurmError("sacct needs slurmdbd, which this test cluster does not run; use job_info(), jobcomp() "
                         "or the job's own output")

    # -- waiting ------------------------------------------------------------------------------------------
    def wait_state(self, jobid: int, states: Union[str, Iterable[str]], timeout: float = 60,
                   poll: float = 0.2) -> str:
        """Wait until the job is in one of STATES; returns the state. Raises TimeoutError (with the job's
        scontrol record) after TIMEOUT s, or SlurmError if the job ends in another state first."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        state = ""
        while True:
            state = self.state(jobid)
            if state in wanted:
                return state
            if state in TERMINAL:
                raise SlurmError(f"job {jobid} ended {state}, never {sorted(wanted)}: {self.job_info(jobid)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid} not {sorted(wanted)} after {timeout} s: {self.job_info(jobid)}")
            time.sleep(poll)

    def wait_done(self, jobid: int, timeout: float = 120, poll: float = 0.2) -> Dict[str, str]:
        """Wait until the job has ended (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...); returns its job_info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(jobid)
            if info.get("JobState") in TERMINAL:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid} not done after {timeout} s: {info}")
            time.sleep(poll)

    def wait_file(self, path: Union[str, Path], text: Optional[str] = None, timeout: float = 60,
                  poll: float = 0.1) -> str:
        """Wait until PATH exists (and contains TEXT); returns its content."""
        path = Path(path)
        deadline = time.monotonic() + timeout
        while True:
            content = path.read_text(errors="replace") if path.exists() else None
            if content is not None and (text is None or text in content):
                return content
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} {'missing' if content is None else f'lacks {text!r}'} after {timeout} s"
                                   + (f"; content:\n{content}" if content else ""))
            time.sleep(poll)

    # -- acting on jobs -----------------------------------------------------------------------------------
    def signal(self, jobid: int, sig: str = "USR1", batch: bool = True, full: bool = False) -> None:
        """scancel --signal=SIG: to the batch shell only (batch=True, the default), the batch shell, its
        children and every step (full=True), or only the job's steps (batch=False, full=False)."""
        args = ["scancel", f"--signal={sig}"]
        if full:
            args.append("--full")
        elif batch:
            args.append("--batch")
        self.run(*args, str(jobid))

    def cancel(self, *jobids: int) -> None:
        if jobids:
            self.run("scancel", *map(str, jobids), check=False)

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job and wait until the queue is empty."""
        ids = [row[0] for row in self.squeue(fmt="%i")]
        if not ids:
            return
        self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while self.squeue(fmt="%i") and time.monotonic() < deadline:
            time.sleep(0.2)

    def requeue(self, jobid: int) -> None:
        """scontrol requeue JOBID (a running job goes back to PENDING; SLURM holds it ~120 s: see requeue_now)."""
        self.run("scontrol", "requeue", str(jobid))

    def requeue_now(self, jobid: int, timeout: float = 60) -> None:
        """Make a requeued job eligible at once: wait until it is PENDING again (SLURM then holds it for
        cred_expire, 120 s by default, Reason=BeginTime), then `scontrol update jobid=J StartTime=now`.
        A test-only shortcut: product code must not rely on it."""
        self.wait_state(jobid, "PENDING", timeout=timeout)
        # slurmd revokes the old instance's credential at the requeue, to the second: a new instance
        # launched within that same second is refused ("Job credential revoked", then FAILED with
        # nothing in the job's log). SLURM's own hold avoids this; this shortcut waits for the next second
        # of the clock slurmd reads (this machine's) to begin, past the one the requeue was seen in.
        seen_in, deadline = int(time.time()), time.monotonic() + 10
        while int(time.time()) <= seen_in and time.monotonic() < deadline:
            time.sleep(0.05)
        self.run("scontrol", "update", f"jobid={jobid}", "StartTime=now")

    def log_tail(self, name: str = "slurmctld.log", lines: int = 30) -> str:
        """The last lines of a daemon log (slurmctld.log, slurmd-NODE.log, jobcomp.log)."""
        path = self.log_dir / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class SlurmHosts(SlurmCluster):
    """The cluster of namespace hosts: client commands run on h1; nodes can be powered off."""

    def __init__(self, env: Dict[str, str] = HOSTS_ENV):
        super().__init__(log_dir=Path(env["SLURM_LOCAL_DIR"]) / "log")
        self.env = dict(env)  # what slurm-local.sh and hosts.sh need to find these hosts
        self.hosts = [f"h{i}" for i in range(1, int(env["SLURM_LOCAL_HOSTS"]) + 1)]

    def on(self, host: str, *argv: Union[str, Path]) -> List[str]:
        """The argv that runs ARGV on HOST (its network, hostname, processes), in the current directory; run
        it with env=self.host_env(...)."""
        return ["bash", str(HOSTS_SH), "run", host, *map(str, argv)]

    def host_env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """A clean environment (clean_env) that hosts.sh finds these hosts with, plus EXTRA."""
        return clean_env({**self.env, **(extra or {})})

    def run(self, *args: Union[str, Path], timeout: float = 60, check: bool = True, cwd: Optional[Path] = None,
            env: Optional[Dict[str, str]] = None, host: str = "h1") -> subprocess.CompletedProcess:
        """Run a command on HOST (h1, the login node, by default); as SlurmCluster.run."""
        return super().run(*self.on(host, *args), timeout=timeout, check=check, cwd=cwd,
                           env={**self.env, **(env or {})})

    def node_state(self, node: str) -> str:
        """sinfo's state of NODE: idle, allocated, mixed, down* ("*": not responding), ..."""
        return self.run("sinfo", "-h", "-n", node, "-o", "%T").stdout.strip()

    def power_off(self, host: str) -> None:
        """Lose a node: SIGKILL every process of HOST at once (slurmd, munged, job steps, workers)."""
        self._tool("hosts.sh off", ["bash", str(HOSTS_SH), "off", host])

    def powered_on(self) -> List[str]:
        """The hosts that are on now."""
        out = self._tool("hosts.sh list", ["bash", str(HOSTS_SH), "list"]).stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def restore(self) -> None:
        """Power every lost host on again and restart its daemons (slurm-local.sh start); returns once every
        node answers again (a DOWN node returns to service when its slurmd registers)."""
        self._tool("slurm-local.sh start", ["bash", str(SCRIPT), "start"], timeout=120)

    def _tool(self, what: str, argv: List[str], timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env={**os.environ, **self.env})
        if proc.returncode != 0:
            raise SlurmError(f"{what} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-1500:]}")
        return proc


def _start_or_skip(extra_env: Optional[Dict[str, str]] = None) -> bool:
    """Start the cluster (the namespace hosts' one with EXTRA_ENV=HOSTS_ENV); returns whether this call started
    it (False: it was running already). Skips (or fails, with SLURM_LOCAL_REQUIRED=1)."""
    required = os.environ.get("SLURM_LOCAL_REQUIRED", "") not in ("", "0")

    def unavailable(reason: str):
        if required:
            pytest.fail(f"SLURM_LOCAL_REQUIRED is set but {reason}", pytrace=False)
        pytest.skip(reason)

    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        unavailable("the local SLURM cluster needs root (scripts/ops/slurm-local.sh runs the daemons as root)")
    env = {**os.environ, "SLURM_LOCAL_NODES": os.environ.get("SLURM_LOCAL_NODES", DEFAULT_NODES), **(extra_env or {})}
    try:
        proc = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900,
                              env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        unavailable(f"scripts/ops/slurm-local.sh start did not finish: {e}")
    if proc.returncode != 0:
        err = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        unavailable(f"scripts/ops/slurm-local.sh start failed (exit {proc.returncode}): {err}")
    return "already running" not in proc.stdout


def _stop(extra_env: Optional[Dict[str, str]] = None) -> None:
    subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True, timeout=120,
                   stdin=subprocess.DEVNULL, env={**os.environ, **(extra_env or {})})


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running local SLURM cluster (a SlurmCluster); stopped at session end if this session started it."""
    started_here = _start_or_skip()
    try:
        yield SlurmCluster()
    finally:
        if started_here:
            _stop()


@pytest.fixture(scope="session")
def slurm_hosts_cluster():
    """A running SLURM cluster of HOSTS namespace hosts (a SlurmHosts); stopped (every host powered off and
    removed) at session end if this session started it."""
    started_here = _start_or_skip(HOSTS_ENV)
    try:
        yield SlurmHosts()
    finally:
        if started_here:
            _stop(HOSTS_ENV)


@pytest.fixture
def slurm_hosts(slurm_hosts_cluster):
    """The session's SlurmHosts for one test; afterwards cancels every job left and brings lost nodes back."""
    cluster = slurm_hosts_cluster
    try:
        yield cluster
    finally:
        if "h1" in cluster.powered_on():  # else slurmctld went with it: restore() starts a fresh cluster
            cluster.cancel_all()
        states = [cluster.node_state(h) for h in cluster.hosts] if "h1" in cluster.powered_on() else []
        if set(cluster.hosts) - set(cluster.powered_on()) or any("down" in s or "*" in s for s in states):
            cluster.restore()


@pytest.fixture
def slurm(slurm_cluster):
    """The session's SlurmCluster for one test; cancels every job left in the queue when the test ends."""
    yield slurm_cluster
    slurm_cluster.cancel_all()

"""Several hosts on this machine for tests: the fixture ``hosts`` over scripts/ops/hosts.sh.

Each host is a network namespace with its own hostname, process tree and address on a private subnet,
joined to the others by a bridge (the script's header has the details). A test gets a factory:

    def test_x(hosts):
        net = hosts(2)                       # h1, h2 up; torn down after the test, even on failure
        proc = net.popen("h1", ["elasticflow", ...])
        net.off("h2"); net.cut("h1"); net.heal("h1"); net.rate("h2", "100mbit")

Skipped, with one line saying why, only where this process lacks the privilege (not root); in CI, which runs
as root, they run, and a root that cannot make namespaces fails the test with the reason.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ops" / "hosts.sh"
ELASTICFLOW = [sys.executable, "-m", "elasticflow.cli"]


class Hosts:
    def __init__(self, n: int, rate: Optional[str] = None, prefix: str = "ef", subnet: str = "10.231.0"):
        self.n, self.env = n, {**os.environ, "EF_HOSTS_PREFIX": prefix, "EF_HOSTS_SUBNET": subnet}
        self.subnet = subnet
        self.procs: List[subprocess.Popen] = []
        self._script("up", str(n), *([rate] if rate else []))

    def _script(self, *args: str) -> str:
        done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=self.env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"hosts.sh {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{int(host[1:])}"

    def popen(self, host: str, args: List[str], env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``args`` on ``host``; stdout and stderr together, as text."""
        # Own process group: kill() reaches the command behind nsenter (which forks it), not only nsenter.
        proc = subprocess.Popen(["bash", str(SCRIPT), "run", host, *map(str, args)], cwd=cwd or REPO,
                                env={**self.env, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen) -> str:
        """SIGKILL a command started by ``popen`` (and what it runs); returns what it printed."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=10)[0] or ""
        except subprocess.TimeoutExpired:  # its workers (own sessions) still hold the pipe: down() ends them
            return ""

    def run(self, host: str, args: List[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), "run", host, *map(str, args)], capture_output=True, text=True,
                              env=self.env, timeout=timeout, cwd=REPO)

    def train(self, host: str, model: Path, run_dir: Path, *overrides: str, env: Optional[dict] = None):
        """`elasticflow train MODEL hydra.run.dir=RUN_DIR OVERRIDES...` on ``host``, in the background."""
        return self.popen(host, [*ELASTICFLOW, "train", model, f"hydra.run.dir={run_dir}", "trainer.progress=false",
                                 *overrides], env=env)

    def off(self, host: str) -> None:
        """Power ``host`` off: every process on it is SIGKILLed at once."""
        self._script("off", host)

    def on(self, host: str) -> None:
        self._script("on", host)

    def cut(self, host: str) -> None:
        """Partition ``host``: its link goes down; peers see silence, not a reset."""
        self._script("cut", host)

    def heal(self, host: str) -> None:
        self._script("heal", host)

    def rate(self, host: str, rate: str) -> None:
        self._script("rate", host, rate)

    def down(self) -> None:
        self._script("down")
        for proc in self.procs:  # the `run` wrappers: their children died with the hosts
            if proc.poll() is None:
                self.kill(proc)


def _check_privilege() -> None:
    if os.geteuid() != 0:
        pytest.skip("multi-host tests need root for network namespaces (CI runs as root)")
    subprocess.run(["ip", "netns", "del", "ef-probe"], capture_output=True)  # a crashed run's
    probe = subprocess.run(["ip", "netns", "add", "ef-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"root, yet cannot make a network namespace: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", "ef-probe"], capture_output=True)


@pytest.fixture
def hosts():
    """A factory: ``hosts(n, rate=None)`` brings up h1..hn; everything is removed after the test."""
    _check_privilege()
    made: List[Hosts] = []

    def make(n: int, rate: Optional[str] = None) -> Hosts:
        net = Hosts(n, rate)
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in made:
            net.down()

"""Local workers forked from the zygote (launchers/zygote.py): each worker is a child of one process that
imported torch once; a killed worker's signal reaches the agent as a Popen's would; a replacement is forked
too; launcher.fork_workers=false starts fresh interpreters; and a zygote that cannot serve falls back."""
from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from elasticflow.launchers import local, zygote

from harness import MODELS, events, finish, members, start, wait_for


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _parents_while_held(run, *overrides):
    """The agent's pid, and each member's parent (its pid, its command line), read while the first step is held."""
    hold = run.parent / f"{run.name}.hold"
    hold.write_text("")
    proc = start(run, "launcher.workers=2", *overrides, env={"EF_PROBE_HOLD": str(hold)})
    try:
        pids = wait_for(lambda: [w["pid"] for w in members(run)] if (run / "workers.json").is_file() else None,
                        120, "two members", proc=proc)
        parents = [(_parent(pid), _command(_parent(pid))) for pid in pids]
    finally:
        hold.unlink()
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    return proc.pid, parents


def test_workers_are_forked_from_the_zygote_unless_told_otherwise(tmp_path):
    agent, parents = _parents_while_held(tmp_path / "forked")
    assert len(parents) == 2 and all("elasticflow.launchers.zygote" in command for _, command in parents), parents
    assert len({pid for pid, _ in parents}) == 1 and agent not in {pid for pid, _ in parents}  # one zygote
    agent, parents = _parents_while_held(tmp_path / "fresh", "launcher.fork_workers=false")
    assert [pid for pid, _ in parents] == [agent, agent], parents


def test_a_killed_forked_worker_is_seen_by_its_signal_and_replaced_by_a_fork(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "launcher.workers=3", "launcher.restart_failed=true", env={"EF_PROBE_KILL": "1:10:forward"})
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    left = events(run, "left")
    assert [(e["worker"], e["cause"]) for e in left] == [(1, "signal SIGKILL")], left
    assert [e["replacing"] for e in events(run, "restart")] == [1]


def test_launch_falls_back_to_a_fresh_interpreter_when_the_zygote_cannot_serve(monkeypatch):
    class Dead:
        def launch(self, env):
            return None

    started = []
    monkeypatch.setattr(local, "ForkServer", Dead)
    monkeypatch.setattr(local, "local_launch", lambda env: started.append(env) or "fresh")
    launch = local.LocalLaunch(fork=True)
    assert launch({"A": "1"}) == "fresh" and launch({"A": "2"}) == "fresh"
    assert started == [{"A": "1"}, {"A": "2"}] and launch.fork is False


def test_a_forked_handle_reports_exit_codes_as_popen_does(tmp_path):
    """A worker without its run's config exits 1; one blocked on a store that never answers, SIGKILLed, reports
    -SIGKILL; after close() the zygote ends with its last worker."""
    from omegaconf import OmegaConf

    from elasticflow.config.schema import compose
    from elasticflow.distributed import protocol

    server = zygote.ForkServer()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: the worker waits in its join
    try:
        failed = server.launch({**os.environ, protocol.ENV_RUN_DIR: str(tmp_path / "nothing")})
        assert failed is not None and failed.wait(120) == 1 and failed.poll() == 1
        (tmp_path / "run" / ".elasticflow").mkdir(parents=True)
        OmegaConf.save(compose(str(MODELS / "linear.py"), ["elastic.timeout_s=600"]),
                       tmp_path / "run" / ".elasticflow" / "config.yaml")
        env = {**os.environ, protocol.ENV_RUN_DIR: str(tmp_path / "run"), protocol.ENV_WORKER_ID: "0",
               protocol.ENV_STORE: f"127.0.0.1:{silent.getsockname()[1]}", protocol.ENV_TOKEN: "t"}
        blocked = server.launch(env)
        silent.settimeout(120)
        silent.accept()  # it is running, and reached the store
        assert blocked.poll() is None
        blocked.kill()
        assert blocked.wait(60) == -signal.SIGKILL
    finally:
        silent.close()
        server.close()
    assert server.proc.returncode == 0  # the zygote ended with its last worker

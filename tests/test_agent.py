"""The agent's bookkeeping, at unit level: a real Agent (its store, events, workers.json) whose launch
callable records each worker's environment instead of starting a process."""
import json
import subprocess
import sys
import textwrap

import pytest

from elasticflow.config.schema import compose
from elasticflow.distributed import protocol
from elasticflow.distributed.agent.agent import Agent
from elasticflow.errors import ElasticFlowError


class FakeProc:
    """Stands in for a worker process: alive until the test sets ``rc``."""

    def __init__(self, pid: int):
        self.pid, self.rc = pid, None

    def poll(self):
        return self.rc


def test_a_replacement_takes_the_local_slot_of_the_worker_it_replaces(tmp_path):
    cfg = compose("models/linear.py", ["launcher.workers=3", "launcher.restart_failed=true"])
    envs, procs = [], []

    def launch(env):
        envs.append(env)
        procs.append(FakeProc(10_000 + len(procs)))
        return procs[-1]

    agent = Agent(cfg, tmp_path, launch=launch)
    state = agent.state
    try:
        for _ in range(3):
            agent.processes.spawn()
        assert [e[protocol.ENV_LOCAL_SLOT] for e in envs] == ["0", "1", "2"]
        state.roster.move_all(list(state.joining.values()), "admitted")  # all three joined
        agent.generations.publish()
        procs[1].rc = -9  # the worker in slot 1 is SIGKILLed
        assert agent.processes.reap() is None
        assert len(envs) == 4, "no replacement was spawned"
        assert envs[3][protocol.ENV_WORKER_ID] == "3" and envs[3][protocol.ENV_LOCAL_SLOT] == "1"
        restart = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()][-1]
        assert restart["event"] == "restart" and restart["replacing"] == 1 and restart["worker"] == 3
        # Two gone at once: their replacements take the two free slots, lowest first.
        procs[0].rc = procs[2].rc = -9
        agent.processes.reap()
        assert [e[protocol.ENV_LOCAL_SLOT] for e in envs[4:]] == ["0", "2"]
    finally:
        agent._stop_serving()


@pytest.mark.timeout(60)
def test_every_worker_dying_before_the_first_generation_ends_the_job(tmp_path):
    """Before, the agent waited forever: nothing was published, so its "no members left" check never ran."""
    cfg = compose("models/linear.py", ["launcher.workers=2", "launcher.restart_failed=false"])

    def launch(env):
        proc = FakeProc(10_000)
        proc.rc = -9  # SIGKILLed while starting, before it asked to join
        return proc

    with pytest.raises(ElasticFlowError, match="every worker died"):
        Agent(cfg, tmp_path, launch=launch).run()
    kinds = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kinds.count("join_failed") == 2


def test_a_join_asked_again_gets_the_same_id_not_a_second_worker(tmp_path):
    """A worker whose verdict came late (a stalled store) asks again under a new number: the agent answers with
    the id it already gave. It used to mint a second id, so the first stayed admitted and the first generation
    waited for a worker that would never come (scripts/bench/bench_control_plane.py, "Connections")."""
    cfg = compose("models/linear.py", ["launcher.workers=1"])
    agent = Agent(cfg, tmp_path, launch=lambda env: FakeProc(10_000))
    state, admission = agent.state, agent.admission
    try:
        spawned = agent.processes.spawn()

        def request(n, nonce):
            fields = (n, spawned.id, spawned.pid, None, "10.0.0.5", nonce)
            return {"id": spawned.id, "pid": spawned.pid, "node": None, "host": "10.0.0.5", "nonce": nonce,
                    "mac": protocol.sign(state.token, protocol.join_message(*fields))}

        first = admission.judge(1, request(1, "a"))
        again = admission.judge(2, request(2, "b"))
        assert first["ok"] and again == first
        assert [w.id for w in state.admitted] == [spawned.id] and not state.joining
        by_hand = {"id": -1, "pid": 4242, "node": None, "host": "10.0.0.6", "nonce": "c"}
        by_hand["mac"] = protocol.sign(state.token, protocol.join_message(3, -1, 4242, None, "10.0.0.6", "c"))
        fresh = admission.judge(3, by_hand)
        assert fresh["ok"] and fresh["id"] != spawned.id and len(state.admitted) == 2  # another process: its own
    finally:
        agent._stop_serving()


def test_every_worker_of_a_large_start_is_answered_though_all_ask_at_once(tmp_path, monkeypatch):
    """600 workers asking in one burst (a job starting at scale): one admission round answers them all, and
    workers.json is written once for the round. The join inbox's backlog was 256: the older requests of a
    burst were dropped unread, their workers asked again 5 s later, and at 1,024 some gave up."""
    from elasticflow.distributed.agent import workers_json

    n = 600
    cfg = compose("models/linear.py", [f"launcher.workers={n}"])
    agent = Agent(cfg, tmp_path, launch=lambda env: FakeProc(10_000))
    state = agent.state
    writes = []
    real_write = workers_json.write
    monkeypatch.setattr(workers_json, "write", lambda *a, **k: (writes.append(1), real_write(*a, **k)))
    try:
        spawned = [agent.processes.spawn() for _ in range(n)]
        for k, w in enumerate(spawned, start=1):  # as Membership.join: count, then write the request
            assert state.store.add("join/count", 1) == k
            fields = (k, w.id, w.pid, None, "10.0.0.5", f"nonce{k}")
            state.store.set(f"join/request/{k}", json.dumps(
                {"id": w.id, "pid": w.pid, "node": None, "host": "10.0.0.5", "nonce": f"nonce{k}",
                 "mac": protocol.sign(state.token, protocol.join_message(*fields))}))
        writes.clear()
        agent.admission.admit()
        answered = [k for k in range(1, n + 1) if state.store.check([protocol.verdict_key(k)])]
        assert len(answered) == n and len(state.admitted) == n and not state.joining
        assert len(writes) == 1
    finally:
        agent._stop_serving()


# The agent's side of a job: the CLI up to the spawn of its workers, the agent, node agents, `elasticflow status`.
AGENT_SIDE = ["elasticflow.cli", "elasticflow.launchers.local", "elasticflow.launchers.nodes",
              "elasticflow.launchers.failover", "elasticflow.launchers.slurm", "elasticflow.launchers.kubernetes",
              "elasticflow.launchers.kubernetes_pod", "elasticflow.distributed.agent.node_agent",
              "elasticflow.observability.status"]


@pytest.mark.timeout(120)
def test_a_standby_that_takes_the_job_over_does_not_act_again_on_an_inject_request_already_answered(tmp_path):
    """launcher.store=etcd's failover: the agent's state handed to a standby (leadership.snapshot/restore) carries
    the inject requests already acted on. Before, the new agent read the inject inbox from its start, and a
    request younger than FRESH_S (300 s) was acted on a second time: a `--kill` killed another member."""
    import secrets
    import time

    from elasticflow.distributed.agent import inject, leadership

    cfg = compose("models/linear.py", ["launcher.workers=2"])
    procs = []

    def launch(env):
        procs.append(FakeProc(10_000 + len(procs)))
        return procs[-1]

    first = Agent(cfg, tmp_path, launch=launch)
    try:
        state = first.state
        for _ in range(2):
            first.processes.spawn()
        state.roster.move_all(list(state.joining.values()), "admitted")
        first.generations.publish()
        nonce, at = secrets.token_hex(8), time.time()
        store = state.store
        store.set(f"{inject.REQUEST_PREFIX}/{protocol.draw(store, inject.COUNT_KEY, inject.COUNT_KEY)}", json.dumps(
            {"action": "slow", "rank": 1, "factor": 2.0, "for_s": 0.0, "nonce": nonce, "time": at, "tensor": "",
             "mac": protocol.sign(state.token, inject.message(state.job, "slow", 1, 2.0, 0.0, nonce, at, ""))}))
        first.injection.serve()
        reply = inject.reply_key(nonce)
        assert json.loads(protocol.Sealer(state.token).open(reply, store.get(reply)))["ok"]
        store.delete_key(reply)  # so that a second answer would show

        standby = Agent(cfg, tmp_path, launch=launch, served=(store, state.address, lambda: None),
                        token=state.token, job=state.job)
        leadership.restore(json.loads(json.dumps(first.state_dict())), standby.state, standby.rdv, standby.hosts,
                           standby.admission, standby.scaling, standby.injection)
        standby.injection.serve()
        assert not store.check([reply]), "the standby acted on the request a second time"
        assert [w.id for w in standby.state.members] == [0, 1]
    finally:
        first._stop_serving()


def test_the_agents_process_imports_no_torch(tmp_path):
    """Torch is the workers' (gloo's rendezvous: store/dist_store.py); an agent that imported it spent most of its CPU
    on it, on every job (docs/benchmarks.md). A fresh interpreter imports the agent's side and runs an agent
    to its end (its store served, every worker dead before joining): torch is still not loaded."""
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {AGENT_SIDE!r}:
            importlib.import_module(name)
        from elasticflow.config.schema import compose
        from elasticflow.distributed.agent.agent import Agent
        from elasticflow.errors import ElasticFlowError

        class Dead:
            pid, rc = 10_000, -9
            def poll(self):
                return self.rc

        try:
            Agent(compose("models/linear.py", ["launcher.workers=2", "launcher.restart_failed=false"]),
                  sys.argv[1], launch=lambda env: Dead()).run()
        except ElasticFlowError as exc:
            print("agent ended:", str(exc)[:80])
        print("torch loaded:", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5])
        """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agent ended: every worker died" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "torch loaded: []" in proc.stdout, proc.stdout

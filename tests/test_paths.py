"""Who may change the folders a job reads code and config from (_util/paths.py): every one of them is checked with
every directory above it, and the workers read config.yaml through descriptors from the run directory the agent
checked. Each attack is made for real by another local user (``nobody``) from a team folder it may write, so
these tests need root (as CI has)."""
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from elasticflow._util.envnames import ENV_RUN_DIR, ENV_RUN_DIR_ID, ENV_STORE, ENV_WORKER_ID
from elasticflow._util.paths import identity, read_beneath
from elasticflow.errors import ElasticFlowError
from elasticflow.launchers.worker import COMMAND

from harness import MODELS, PROBE, assert_equivalent, cli, finish, logged_step, start, train_ok, wait_for


# The digits MLP, from a file that leaves a mark when it is imported: the proof that a refused job read no code.
MARKING = f"""
import os
import sys

sys.path.insert(0, {str(MODELS)!r})
from digits_mlp import data, forward, model  # noqa: E402,F401

open(os.environ["EF_MARK"], "w").write("imported")
"""


def _as_nobody(command: str) -> subprocess.CompletedProcess:
    """``sh -c COMMAND`` as the local user ``nobody`` (no groups)."""
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sh", "-c", command],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def team():
    """A folder under /tmp every local user may reach, as a team folder is (pytest's tmp_path is root's 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="ef-team-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="sets modes of folders others may write: needs root (as CI has)")
def test_a_job_under_a_folder_others_may_write_is_refused_before_any_code_is_read(team, tmp_path):
    """The run directory is root's own 0755, but its parent is a team folder every user may write, without the
    sticky bit: ``nobody`` could rename the run directory away and put one of its own there, whose config.yaml
    the workers import code from. The job refuses it in one line before it reads any code (the model file would
    leave a mark), and so it does a checkpoint folder there, and a model file in a folder others may write, even
    a sticky one (it is first on sys.path while the model file is imported). Under a sticky folder, as /tmp is,
    or with launcher.trust_shared_dirs=true, it runs."""
    mark = tmp_path / "imported"
    model = tmp_path / "model.py"
    model.write_text(MARKING)
    env = {"EF_MARK": str(mark)}
    shared = team / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    run = shared / "run"
    out = cli(["train", model, f"hydra.run.dir={run}", "trainer.max_steps=1"], env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: the run directory {run} lies under {shared}, which may be written by others (mode 777), so it can "
        "be renamed away and replaced: whoever can write there can change what the job reads back and run code as "
        "you",
        f"hint: use a folder whose parents only their owners may write (chmod o-w,g-w {shared}, or chmod +t {shared} "
        "as /tmp is), or pass launcher.trust_shared_dirs=true if everyone who can write there is trusted"]
    assert not mark.exists() and not (run / ".elasticflow").exists()
    mine = tmp_path / "mine"
    out = cli(["train", model, f"hydra.run.dir={mine}", "trainer.max_steps=1", f"checkpoint.dir={shared}/ck"], env=env)
    assert out.returncode == 2 and f"error: the checkpoint folder {shared}/ck lies under {shared}" in out.stderr
    sticky = team / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    for folder in (shared, sticky):
        (folder / "model.py").write_text(model.read_text())
        out = cli(["train", folder / "model.py", f"hydra.run.dir={mine}", "trainer.max_steps=1"], env=env)
        assert out.returncode == 2, out.stderr
        mode = f"{folder.stat().st_mode & 0o7777:o}"
        assert out.stderr.splitlines()[0] == (
            f"error: the model file's folder {folder} may be written by others (mode {mode}): whoever can write "
            "there can change what the job reads back and run code as you"), out.stderr
    assert not mark.exists() and not (mine / ".elasticflow").exists()
    ok = cli(["train", model, f"hydra.run.dir={sticky}/run", "trainer.max_steps=1"], env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert mark.exists()
    trusted = cli(["train", model, f"hydra.run.dir={run}", "trainer.max_steps=1", "launcher.trust_shared_dirs=true"],
                  env=env)
    assert trusted.returncode == 0, trusted.stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="attacks as another user (nobody): needs root (as CI has)")
def test_a_run_directory_swapped_after_the_check_is_not_read(team, tmp_path, reference):
    """The swap itself, for real, past the check (as under launcher.trust_shared_dirs=true): ``nobody`` renames a
    run directory away from under a team folder it may write, and puts its own in its place, whose config.yaml
    names its own model file. A worker the agent starts after that (a replacement, a joiner) reads config.yaml
    only from the run directory the agent checked (its st_dev:st_ino, in the worker's environment), through
    descriptors: it refuses in one line, writes nothing there, and the stranger's model file is never imported.
    A 3-worker job under a sticky team folder ends on the 1-worker parameters, each worker having read its
    config that way."""
    sticky = team / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    proc = start(sticky / "run", "launcher.workers=3")
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert_equivalent(sticky / "run", reference)

    shared = team / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    run = shared / "run"  # as the agent leaves it: config.yaml in its 0700 .elasticflow/, naming the job's model
    (run / ".elasticflow").mkdir(parents=True, mode=0o700)
    (run / ".elasticflow" / "config.yaml").write_text(f"model: {PROBE}\n")
    checked = os.stat(run)
    mark = team / "imported"
    evil = shared / "evil"
    swapped = _as_nobody(
        f"set -e; mv {run} {shared}/away; mkdir -p {run}/.elasticflow {evil}; chmod 777 {evil}; "
        f"echo 'open(\"{mark}\", \"w\").write(\"imported\")' > {evil}/model.py; "
        f"echo 'model: {evil}/model.py' > {run}/.elasticflow/config.yaml")
    assert swapped.returncode == 0, swapped.stderr
    worker = subprocess.run(COMMAND, capture_output=True, text=True, timeout=120, env={
        **os.environ, ENV_RUN_DIR: str(run), ENV_RUN_DIR_ID: f"{checked.st_dev}:{checked.st_ino}",
        ENV_WORKER_ID: "3", ENV_STORE: "unix:/nonexistent"})
    assert worker.returncode == 1, worker.stderr
    assert worker.stderr.splitlines()[-2:] == [
        f"error: worker 3: the run directory {run} is not the one the job started in: it was renamed or replaced "
        f"since (st_dev:st_ino now {os.stat(run).st_dev}:{os.stat(run).st_ino}, at the start "
        f"{checked.st_dev}:{checked.st_ino}); nothing of it was read",
        "hint: start the job again in a directory whose parents only you may write"], worker.stderr
    assert not mark.exists()
    assert sorted(p.name for p in run.iterdir()) == [".elasticflow"]  # no log, no error record written there
    # In the run directory as it was, the same worker would read it: the refusal is the swap's, not the path's.
    assert read_beneath(shared / "away", (".elasticflow", "config.yaml"), f"{checked.st_dev}:{checked.st_ino}"
                        ) == f"model: {PROBE}\n".encode()
    # A worker srun started (another host: the inode alone, "*:st_ino", paths.identity(across_hosts=True)) refuses the
    # swapped directory too, and reads the one it was handed
    srun = subprocess.run(COMMAND, capture_output=True, text=True, timeout=120, env={
        **os.environ, ENV_RUN_DIR: str(run), ENV_RUN_DIR_ID: f"*:{checked.st_ino}", ENV_WORKER_ID: "4",
        ENV_STORE: "unix:/nonexistent"})
    assert srun.returncode == 1 and "is not the one the job started in" in srun.stderr, srun.stderr
    assert not mark.exists()
    assert identity(shared / "away", across_hosts=True) == f"*:{checked.st_ino}"
    assert read_beneath(shared / "away", (".elasticflow", "config.yaml"), identity(shared / "away", across_hosts=True)
                        ) == f"model: {PROBE}\n".encode()


def _swapped_mid_run(team, workers: int):
    """A job of ``workers`` under a folder ``nobody`` may write (started with launcher.trust_shared_dirs=true, so
    that the swap can be made), steps of 0.1 s; at step 12 (its checkpoint of step 10 written) ``nobody`` renames
    its run directory away and makes its own in its place. (run, where it went, the job's pids, its output),
    once the job ended."""
    shared = team / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    run, away, pace = shared / "run", shared / "away", team / "pace"
    pace.touch()  # steps of 0.1 s while it exists: the swap comes mid-run
    proc = start(run, f"launcher.workers={workers}", "launcher.trust_shared_dirs=true", "checkpoint.interval.steps=10",
                 env={"EF_PROBE_SLEEP": "0.1", "EF_PROBE_PACE": str(pace)})
    try:
        wait_for(lambda: logged_step(run) >= 12, 120, "step 12", proc=proc)
        pids = [m["pid"] for m in json.loads((run / "workers.json").read_text())["members"]] if workers > 1 else []
        swapped = _as_nobody(f"set -e; mv {run} {away}; mkdir {run}; chmod 777 {run}")
        assert swapped.returncode == 0, swapped.stderr
        out = finish(proc, 60)
    finally:
        pace.unlink()
    assert proc.returncode == 1, out[-4000:]
    assert (f"error: the run directory {run} was renamed or replaced while the job ran (it is now {away}): the "
            "job stopped, and wrote nothing more into the directory at that path") in out, out[-4000:]
    assert "hint: the checkpoints are in the directory where it is now" in out
    assert sorted(run.iterdir()) == [], f"the job wrote into the directory in its place: {sorted(run.rglob('*'))}"
    return run, away, pids, out


def test_a_run_directory_swapped_while_the_job_runs_stops_it_and_nothing_is_written_there(team, reference):
    """The same swap while a 3-worker job trains: the agent holds the run directory open and sees within a round
    of its loop that the path leads elsewhere; it SIGKILLs every worker and stops in one line that says where
    the run directory is now, and nothing of the job is written into the directory put in its place. The run
    goes on from where it is now, from its step-10 checkpoint, to the 1-worker parameters."""
    run, away, pids, out = _swapped_mid_run(team, 3)
    for pid in pids:  # every worker gone with the job: none is left to write there
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert logged_step(away) < 60 and (away / "checkpoints").is_dir()
    # Where it is now, the run goes on (the shared folder still needs trust): the job equals the 1-worker one
    rest = train_ok(away, "launcher.workers=3", "launcher.trust_shared_dirs=true", "checkpoint.interval.steps=10")
    assert "resumed from" in rest, rest[-3000:]
    assert_equivalent(away, reference, redone=True)


def test_a_run_directory_swapped_under_a_job_that_trains_alone_stops_it_at_the_next_save(team):
    """launcher.workers=1 trains in the CLI's process, with no agent to watch: its next checkpoint sees that the
    run directory's path leads elsewhere and refuses to write, in the same line; nothing is written there."""
    _, away, _, _ = _swapped_mid_run(team, 1)
    assert 12 <= logged_step(away) <= 20


READ_CONFIG = ("import os; from pathlib import Path; from elasticflow.launchers import worker; "
               "worker._read_config(Path(os.environ['ELASTICFLOW_RUN_DIR']), int(os.environ['ELASTICFLOW_WORKER_ID']))")


class _AgentStore:
    """The job's store as a node agent registering with it sees it: a dict, and the agent's verdict on the node's
    request, with the probe files the agent writes in the run directory and checkpoint.dir (agent/hosts.py)."""

    def __init__(self, token: str, run: Path, ckpt: Path):
        self.data, self.token, self.run, self.ckpt = {}, token, run, ckpt

    def compare_set(self, key, expected, desired):
        if key not in self.data:
            if expected != "":
                return expected.encode()
            self.data[key] = desired.encode()
        elif self.data[key] == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else value.encode()
        if key.startswith("node/request/"):
            import json
            import secrets

            from elasticflow.distributed import protocol

            request, probe = json.loads(value), secrets.token_hex(8)
            for folder in (self.run / ".elasticflow" / "hosts", self.ckpt):
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f".probe-{request['name']}-{probe}").write_text(probe)
            verdict = json.dumps({"ok": True, "job": "j0", "run_dir": str(self.run), "checkpoint_dir": str(self.ckpt),
                                  "probe": probe, "nonce": request["nonce"]})
            self.set(key.replace("request", "verdict"), protocol.Sealer(self.token).seal(
                key.replace("request", "verdict"), verdict))

    def add(self, key, n):
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])

    def clone(self):
        return self


@pytest.mark.skipif(os.geteuid() != 0, reason="attacks as another user (nobody): needs root (as CI has)")
def test_a_node_agents_workers_read_only_the_run_directory_it_checked(team, monkeypatch):
    """launcher=nodes: a node agent (another host's, a SLURM worker job's, a pod's) registers, finds the probe the
    agent just wrote in the run directory, and passes its workers that directory's identity as this host sees it.
    ``nobody`` then swaps the run directory from under a team folder it may write, and plants a config.yaml naming
    its own model file: the worker the node agent starts next (a restart, a joiner) refuses it in one line and
    imports nothing. A swap while the node agent checks is refused by the node agent itself."""
    from omegaconf import OmegaConf

    from elasticflow.distributed.agent import node_agent

    shared = team / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    run, token = shared / "run", "3f1c9a7be2d4405f8c6a1d2e9b7f0a53"
    (run / ".elasticflow").mkdir(parents=True, mode=0o700)
    (run / ".elasticflow" / "config.yaml").write_text(f"model: {PROBE}\n")
    store = _AgentStore(token, run, team / "ckpt")
    monkeypatch.setattr(node_agent, "connect", lambda *args, **kwargs: store)
    cfg = OmegaConf.create({"launcher": {"name": "nodes", "store": "token", "procs_per_node": 1},
                            "elastic": {"wait_s": 5}})
    started = []

    def launch(env):  # a worker's first act, before it imports torch (the whole worker: the test above)
        started.append(env)
        return subprocess.Popen([sys.executable, "-c", READ_CONFIG], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    node = node_agent.NodeAgent(cfg, "10.0.0.1:29400", token, launch, bind="127.0.0.1", name="hostb")
    node.register()
    checked = os.stat(run)
    assert node.run_dir_id == f"{checked.st_dev}:{checked.st_ino}"
    mark, evil = team / "imported", shared / "evil"
    swapped = _as_nobody(
        f"set -e; mv {run} {shared}/away; mkdir -p {run}/.elasticflow {evil}; chmod 777 {evil}; "
        f"echo 'open(\"{mark}\", \"w\").write(\"imported\")' > {evil}/model.py; "
        f"echo 'model: {evil}/model.py' > {run}/.elasticflow/config.yaml")
    assert swapped.returncode == 0, swapped.stderr
    node.spawn()
    worker = node.workers.popitem()[1]
    _, err = worker.communicate(timeout=120)
    assert started[-1][ENV_RUN_DIR_ID] == node.run_dir_id and worker.returncode == 1, err
    assert err.splitlines()[-2:] == [
        f"error: worker {started[-1][ENV_WORKER_ID]}: the run directory {run} is not the one the job started in: it "
        f"was renamed or replaced since (st_dev:st_ino now {os.stat(run).st_dev}:{os.stat(run).st_ino}, at the "
        f"start {node.run_dir_id}); nothing of it was read",
        "hint: start the job again in a directory whose parents only you may write"], err
    assert not mark.exists() and sorted(p.name for p in run.iterdir()) == [".elasticflow"]
    assert read_beneath(shared / "away", (".elasticflow", "config.yaml"), node.run_dir_id) == f"model: {PROBE}\n".encode()

    def swapped_while_checking(*args):  # the run directory renamed away between the node agent's looks
        os.rename(run, shared / "elsewhere")
        os.rename(shared / "away", run)
    monkeypatch.setattr(node_agent, "check_shared", swapped_while_checking)
    with pytest.raises(ElasticFlowError, match=f"host hostc: the run directory {run} was renamed or replaced while "
                                               "this host checked it"):
        node_agent.NodeAgent(cfg, "10.0.0.1:29400", token, launch, bind="127.0.0.1", name="hostc").register()


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user: needs root (as CI has)")
def test_the_run_files_are_read_only_through_no_symlink_and_only_if_yours(tmp_path):
    """read_beneath, which the workers read config.yaml with (and export the run's overrides): a symlink planted
    at any step is not followed, and a directory or file another user owns, or others may write, is refused."""
    state = tmp_path / "run" / ".elasticflow"
    state.mkdir(parents=True, mode=0o700)
    (tmp_path / "elsewhere.yaml").write_text("model: /elsewhere.py\n")
    (state / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    with pytest.raises(ElasticFlowError, match="config.yaml is a symlink"):
        read_beneath(tmp_path / "run", (".elasticflow", "config.yaml"))
    (state / "config.yaml").unlink()
    (state / "config.yaml").write_text("model: /mine.py\n")
    assert read_beneath(tmp_path / "run", (".elasticflow", "config.yaml")) == b"model: /mine.py\n"
    os.chown(state / "config.yaml", pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(ElasticFlowError, match=f"belongs to uid {pwd.getpwnam('nobody').pw_uid}, not to you"):
        read_beneath(tmp_path / "run", (".elasticflow", "config.yaml"))
    os.chown(state / "config.yaml", 0, -1)
    (state / "config.yaml").chmod(0o666)
    with pytest.raises(ElasticFlowError, match=r"may be written by others \(mode 666\)"):
        read_beneath(tmp_path / "run", (".elasticflow", "config.yaml"))
    shutil.rmtree(state)
    (tmp_path / "run" / ".elasticflow").symlink_to(tmp_path)
    with pytest.raises(ElasticFlowError, match=r"\.elasticflow is a symlink"):
        read_beneath(tmp_path / "run", (".elasticflow", "elsewhere.yaml"))

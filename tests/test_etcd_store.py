"""distributed/store/etcd.py and agent/leadership.py against a real one-member etcd on loopback with mutual TLS
(tests/etcd_cluster.py): the Store's semantics under the job's prefix, a dead endpoint passed over, the leader
key held by a lease, and a fenced client that can write nothing once its lease is gone."""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import threading

import pytest
from etcd_cluster import ETCD_LOCAL, EtcdCluster

from elasticflow.distributed.agent.leadership import Leadership
from elasticflow.distributed.store import stores
from elasticflow.distributed.store.etcd import Deposed, EtcdStore, address

TOKEN = "5a1e" * 8


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), {"m1": "127.0.0.1"},
                          start=lambda name, args: subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                                                    stderr=subprocess.DEVNULL))
    cluster.start()
    cluster.wait_ready(lambda args: subprocess.run(args, capture_output=True, text=True, timeout=90))
    yield cluster
    cluster.stop()


def client(etcd, prefix: str, endpoints=None, timeout_s: float = 5, fence=None) -> EtcdStore:
    t = etcd.tls
    addr = address(endpoints or etcd.endpoints, prefix, t["ca"], t["cert"], t["key"])
    return EtcdStore(addr, datetime.timedelta(seconds=timeout_s), fence=fence)


def test_the_store_keeps_tcpstores_semantics_under_the_jobs_prefix(etcd):
    store = stores.connect(client(etcd, "job-a/").addr, 5.0)  # the address the workers are handed
    other = client(etcd, "job-b/")
    store.set("k", "v")
    assert store.get("k") == b"v" and store.check(["k"]) and not other.check(["k"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "first") == b"first"      # absent: set
    assert store.compare_set("c", "wrong", "x") == b"first"     # mismatch: the current value, unchanged
    assert store.compare_set("absent", "x", "y") == b"x"       # absent and not expected empty: expected back
    assert sorted(store.list_keys()) == ["c", "k", "n"] and store.num_keys() == 3
    assert store.delete_key("k") and not store.check(["k"])
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(Exception, match="wait timeout"):
        store.get("never")


def test_a_member_that_does_not_answer_is_passed_over(etcd):
    dead = "https://127.0.0.1:9"  # nothing listens there: refused at once, as a powered-off member's host would
    store = client(etcd, "job-c/", endpoints=[dead, *etcd.endpoints])
    store.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(Exception, match="no etcd member answered"):
        client(etcd, "job-c/", endpoints=[dead], timeout_s=0.5).set("k", "w")


def test_the_leader_key_is_held_by_a_lease_and_a_fenced_client_writes_only_while_it_leads(etcd):
    first, second = (Leadership(client(etcd, "job-d/"), TOKEN, lease_s=2) for _ in range(2))
    assert first.claim() and not second.claim()
    assert first.holder() == first.name
    fenced = first.fenced()
    fenced.set("gen/current", "1")
    assert fenced.add("join/count", 1) == 1
    first.store.revoke(first.lease)  # as when the lease expires: the key goes with it
    assert first.holder() is None and second.claim() and second.holder() == second.name
    with pytest.raises(Deposed):
        fenced.set("gen/current", "2")
    with pytest.raises(Deposed):
        fenced.add("join/count", 1)
    with pytest.raises(Deposed):
        fenced.compare_set("gen/current", "1", "2")  # it would have written
    assert fenced.compare_set("gen/current", "other", "2") == b"1"  # a read (untrusted.read's) still answers
    assert second.fenced().compare_set("gen/current", "1", "2") == b"2"


def test_a_new_job_wipes_what_an_old_one_left_but_the_leader_key(etcd):
    lead = Leadership(client(etcd, "job-e/"), TOKEN, lease_s=2)
    old = client(etcd, "job-e/")
    for key in ("gen/current", "agent/state", "join/count", "zzz"):
        old.set(key, "old")
    assert lead.claim()
    lead.fenced().wipe_except("agent/leader")
    assert old.list_keys() == ["agent/leader"] and lead.holder() == lead.name
    assert lead.state() is None


def test_tls_files_a_host_cannot_read_and_a_cluster_that_does_not_answer_are_one_line_each(etcd, tmp_path):
    """As a user meets them: `elasticflow train ... launcher.store=etcd` with a missing CA file, then with every
    endpoint dead; one error line with a hint each, nothing written to the checkpoints."""
    from harness import PROBE, TOKEN as STRONG, train_in_process

    def assert_one_error(proc, message):
        lines = proc.stderr.splitlines()
        errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
        assert proc.returncode not in (0, None) and len(errors) == 1, proc.stderr
        assert message in lines[errors[0]] and lines[errors[0] + 1].startswith("hint: "), proc.stderr

    t = etcd.tls
    common = ["launcher=nodes", "launcher.store=etcd", f"launcher.etcd.cert={t['cert']}",
              f"launcher.etcd.key={t['key']}", "elastic.wait_s=3", "launcher.procs_per_node=1"]
    env = {"ELASTICFLOW_JOB_TOKEN": STRONG}
    missing = train_in_process(PROBE, tmp_path / "a", *common, f"launcher.etcd.endpoints=[{etcd.endpoints[0]}]",
                               f"launcher.etcd.ca={tmp_path / 'nope.pem'}", env=env)
    assert_one_error(missing, f"launcher.etcd.ca='{tmp_path / 'nope.pem'}' is not a file this host can read")
    dead = train_in_process(PROBE, tmp_path / "b", *common, "launcher.etcd.endpoints=[https://127.0.0.1:9]",
                            f"launcher.etcd.ca={t['ca']}", env=env)
    assert_one_error(dead, "no etcd member of launcher.etcd.endpoints answers")
    assert "Traceback" not in missing.stderr + dead.stderr
    assert not (tmp_path / "b" / "checkpoints").exists()
    # In a process that goes on (fit(), this one), the failed start's standby agent was told to stop: it used to
    # campaign on, logging "could not reach etcd" into whatever ran next
    standbys = [t for t in threading.enumerate() if t.name == "elasticflow-standby"]
    assert all(t.stop.is_set() for t in standbys), standbys


def test_a_leader_key_another_certificate_forged_is_no_leader_and_is_claimed_over(etcd, caplog):
    """Another job's certificate (the same CA) finds the job's leader key and puts its own, with no lease: it
    would stand for ever. It does not verify with the token: refused and logged once, the fenced agent is
    deposed by it, and one claim (of two racing) replaces it, after which the new leader's writes go through."""
    import json
    import sys

    from etcd_cluster import DEPOSE

    from elasticflow._util.sealing import REFUSED

    lead, rival = (Leadership(client(etcd, "job-f/"), TOKEN, lease_s=2) for _ in range(2))
    assert lead.claim()
    fenced = lead.fenced()
    fenced.set("gen/current", "1")
    done = subprocess.run([sys.executable, "-c", DEPOSE, etcd.endpoints[0], json.dumps(etcd.stranger())],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "job-f/agent/leader" in json.loads(done.stdout), done.stderr
    REFUSED.counts.pop("agent leader", None)
    with pytest.raises(Deposed):
        fenced.set("gen/current", "2")
    with caplog.at_level("WARNING", logger="elasticflow"):
        assert lead.holder() is None and rival.holder() is None
    refused = [r.getMessage() for r in caplog.records if "forged agent leader" in r.getMessage()]
    assert len(refused) == 1 and REFUSED.counts["agent leader"] == 2, caplog.text
    assert lead.claim() and lead.forged and not rival.claim()  # compared with the forged value: one wins
    assert lead.holder() == lead.name == rival.holder()
    lead.fenced().set("gen/current", "3")
    assert lead.store.get("gen/current") == b"3"
    lead.resign()
    assert rival.holder() is None and rival.claim() and not rival.forged  # its lease held the key: it went too


def test_a_leaders_own_record_copied_back_without_its_lease_is_no_leader(etcd):
    """The stranger reads the leader's sealed record and puts it back with no lease: it verifies, but would
    outlive the leader's host. It is no leader's unless held by the lease it names, so a standby claims over it."""
    lead, rival = (Leadership(client(etcd, "job-g/"), TOKEN, lease_s=2) for _ in range(2))
    assert lead.claim() and not rival.claim()
    raw, lease = lead.store.entry("agent/leader")
    assert lease == lead.lease
    client(etcd, "job-g/").set("agent/leader", raw)  # a plain put: the key loses its lease
    assert lead.store.entry("agent/leader") == (raw, "0")
    assert rival.holder() is None and rival.claim() and rival.forged and rival.holder() == rival.name
    with pytest.raises(Deposed):
        lead.fenced().set("gen/current", "1")


# ---------------------------------------------------------------- a user and role per job (etcd's authentication)
@pytest.fixture(scope="module")
def etcd_auth(tmp_path_factory):
    """A second one-member cluster (127.0.0.2), authentication on, set up as docs/multi-host.md says
    (``EtcdCluster.users``: scripts/ops/etcd-local.sh): a role and a user per job limited to its prefix (job1/,
    job2/). Yields (cluster, {user: (tls, password file)})."""
    folder = tmp_path_factory.mktemp("etcd-auth")
    cluster = EtcdCluster(folder, {"m1": "127.0.0.2"},
                          start=lambda name, args: subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                                                    stderr=subprocess.DEVNULL))
    cluster.start()
    cluster.wait_ready(lambda args: subprocess.run(args, capture_output=True, text=True, timeout=90))
    users = cluster.users(("job1", "job2"), lambda args: subprocess.run(args, capture_output=True, text=True,
                                                                         timeout=60))
    for _, password in users.values():  # made by the script: owner-only, a random password
        assert password.stat().st_mode & 0o077 == 0 and len(password.read_text().strip()) == 32
    yield cluster, users
    cluster.stop()


def login(cluster, users, job, prefix, user=None, timeout_s: float = 5) -> EtcdStore:
    tls, password = users[job]
    addr = address(cluster.endpoints, prefix, tls["ca"], tls["cert"], tls["key"], user=user or job,
                   password_file=str(password))
    return EtcdStore(addr, datetime.timedelta(seconds=timeout_s))


def test_a_job_logs_in_as_its_user_and_another_jobs_user_cannot_reach_its_keys(etcd_auth):
    """The job's user does all a job does under its prefix (records, counters, the leader's lease); another job's
    user, and a client that does not log in, can neither list, read, write nor delete any of it. A token that
    lapsed is replaced by logging in again; a wrong password is one line."""
    cluster, users = etcd_auth
    store = login(cluster, users, "job1", "job1/")
    store.set("k", "v")
    assert store.get("k") == b"v" and store.add("n", 2) == 2 and store.compare_set("c", "", "x") == b"x"
    assert sorted(store.list_keys()) == ["c", "k", "n"]
    lead = Leadership(login(cluster, users, "job1", "job1/"), TOKEN, 2.0)
    assert lead.claim() and lead.holder() is not None
    store._auth = "lapsed.12"  # as after --auth-token-ttl unused: etcd says the token is invalid
    assert store.get("k") == b"v" and store._auth != "lapsed.12"

    other = login(cluster, users, "job2", "job1/")  # another job's user, aimed at job1's prefix
    for attempt in (lambda: other.check(["k"]), other.list_keys, lambda: other.set("agent/leader", "forged"),
                    lambda: other.delete_key("k")):
        with pytest.raises(Exception, match="permission denied"):
            attempt()
    with pytest.raises(Exception, match="permission denied"):  # every key of the cluster, as DEPOSE lists them
        other.post("/v3/kv/range", {"key": "AA==", "range_end": "AA==", "keys_only": True})
    tls = users["job2"][0]
    anonymous = EtcdStore(address(cluster.endpoints, "job1/", tls["ca"], tls["cert"], tls["key"]),
                          datetime.timedelta(seconds=5))
    with pytest.raises(Exception, match="etcd refused"):
        anonymous.check(["k"])
    assert store.get("k") == b"v" and lead.holder() is not None  # job1's keys untouched
    wrong = login(cluster, users, "job1", "job1/", user="job2")  # job2's name with job1's password
    with pytest.raises(Exception, match="etcd refused the login of user 'job2'"):
        wrong.check(["k"])


def test_a_bad_etcd_login_setting_is_one_error_line_with_a_hint(tmp_path):
    from elasticflow.launchers.failover import _login
    from elasticflow.errors import ElasticFlowError
    from types import SimpleNamespace as NS

    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    secret.chmod(0o640)
    for e, match in ((NS(user="job1", password_file=None, prefix="job1/"), "launcher.etcd.password_file is not set"),
                     (NS(user="job1", password_file=str(secret), prefix=None), "needs launcher.etcd.prefix"),
                     (NS(user="job1", password_file=str(tmp_path / "no"), prefix="job1/"),
                      "cannot read launcher.etcd.password_file=.* \\(No such file or directory\\)"),
                     (NS(user="job1", password_file=str(secret), prefix="job1/"), "can be read by others")):
        with pytest.raises(ElasticFlowError, match=match) as err:
            _login(e)
        assert err.value.hint
    # The script that makes a job's user refuses the same way, before it reaches any cluster.
    for args, match in ((["add-job", "job1", "job1", secret], "PREFIX must end with /"),
                        (["add-job", "job1", "job1/", secret], "can be read by others \\(mode 640\\): chmod 600"),
                        (["auth-on"], "usage:")):
        done = subprocess.run(["bash", str(ETCD_LOCAL), *map(str, args)], capture_output=True, text=True,
                              env={**os.environ, "ETCDCTL_ENDPOINTS": "https://127.0.0.9:1"}, timeout=30)
        assert done.returncode == 1 and re.fullmatch(f"etcd-local: .*{match}.*\n", done.stderr), done.stderr
    secret.chmod(0o600)
    assert _login(NS(user="job1", password_file=str(secret), prefix="job1/")) == ("job1", str(secret))
    assert _login(NS(user=None, password_file=None, prefix=None)) == ("", "")

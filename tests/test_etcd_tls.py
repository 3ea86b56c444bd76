"""eft against etcd as it is deployed: TLS with client certificates, user/password auth,
and a role per run limited to the run's key prefix (RBAC)."""

import subprocess
import time
import uuid

import pytest

from bench.launch import WORKERS, eft_run, rdzv_command
from elasticft.contract.keys import RunKeys
from elasticft.store import StoreError, StoreOptions, connect
from tests.etcd_tls import DeployedEtcd, etcd_keys, make_certs
from tests.test_eft_run import assert_one_line_error


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tls-etcd")
    etcd = DeployedEtcd(workdir, make_certs(workdir / "certs")).start()
    yield etcd
    etcd.stop()


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    """etcd with auth enabled, and runs ``a`` and ``b`` each with a user whose role
    covers the run's keys only."""
    etcd = DeployedEtcd(tmp_path_factory.mktemp("auth-etcd")).start()
    etcd.enable_auth()
    for run in ("a", "b"):
        etcd.add_run_user(f"user-{run}", f"pw-{run}", RunKeys(f"run-{run}").root)
    yield etcd
    etcd.stop()


def run_eft(etcd: DeployedEtcd, run_id: str, conf: str, out, timeout: float = 120) -> subprocess.CompletedProcess:
    """eft-run of one node training toy_train for 3 iterations."""
    program = [str(WORKERS / "toy_train.py"), str(out), "--ckpt", str(out / "ckpt"), "--iters", "3"]
    cmd = rdzv_command(eft_run(), *program, nnodes="1", nproc=1, backend="etcd-v3", endpoint=etcd.endpoint,
                       run_id=run_id, flags=["--monitor-interval", "0.1",
                                             "--rdzv-conf", ",".join(filter(None, ["join_timeout=60", conf]))])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# -- TLS ---------------------------------------------------------------------------


def test_client_with_the_trusted_certificate_reads_and_writes(tls_etcd):
    client = connect(tls_etcd.options())
    client.put("/tls-check", "1")
    assert client.get("/tls-check").value == b"1"
    client.close()


@pytest.mark.slow
def test_a_key_that_is_not_the_certificates_is_named_at_once_not_waited_on(tls_etcd):
    # gRPC reports it as an unreachable etcd, in words of its release: eft's own handshake names it
    cert, _ = tls_etcd.certs.client
    _, stranger_key = tls_etcd.certs.stranger
    options = StoreOptions(tls_etcd.endpoint, cacert=str(tls_etcd.certs.ca), cert=str(cert), key=str(stranger_key),
                           timeout=3)
    started = time.monotonic()
    with pytest.raises(StoreError) as refused:
        connect(options)
    assert f"cannot load cert {cert} with key {stranger_key}" in str(refused.value)
    assert "\n" not in str(refused.value) and time.monotonic() - started < 10


def test_eft_run_trains_over_tls_and_its_keys_are_in_that_etcd(tls_etcd, tmp_path):
    run_id = uuid.uuid4().hex
    result = run_eft(tls_etcd, run_id, tls_etcd.rdzv_conf(), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "events.jsonl").exists()
    assert etcd_keys(tls_etcd, RunKeys(run_id).root), "the run left no keys in the TLS etcd"


def test_eft_run_without_a_client_certificate_fails_in_one_line(tls_etcd, tmp_path):
    result = run_eft(tls_etcd, uuid.uuid4().hex, f"cacert={tls_etcd.certs.ca}", tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, tls_etcd.endpoint, "client certificate")


def test_eft_run_with_a_certificate_of_another_ca_fails_in_one_line(tls_etcd, tmp_path):
    cert, key = tls_etcd.certs.stranger
    result = run_eft(tls_etcd, uuid.uuid4().hex, f"cacert={tls_etcd.certs.ca},cert={cert},key={key}",
                     tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, tls_etcd.endpoint, str(cert))


def test_eft_run_trusting_another_ca_fails_in_one_line(tls_etcd, tmp_path):
    """etcd's own certificate checked against a CA that did not sign it."""
    other_ca = tls_etcd.certs.stranger[0].parent / "other-ca.crt"
    cert, key = tls_etcd.certs.client
    result = run_eft(tls_etcd, uuid.uuid4().hex, f"cacert={other_ca},cert={cert},key={key}", tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, tls_etcd.endpoint, "TLS server certificate", "cacert")


def test_https_endpoint_without_cacert_fails_in_one_line(tls_etcd, tmp_path):
    result = run_eft(tls_etcd, uuid.uuid4().hex, "", tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, "cacert")


# -- user/password and RBAC ---------------------------------------------------------


def test_wrong_password_fails_in_one_line(auth_etcd, tmp_path):
    result = run_eft(auth_etcd, "run-a", "user=user-a,password=wrong", tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, "authentication failed")


def test_a_runs_user_cannot_read_or_write_another_runs_keys(auth_etcd):
    root = connect(auth_etcd.root_options())
    key_of_b = RunKeys("run-b").root + "secret"
    root.put(key_of_b, "b's")
    a = connect(auth_etcd.options(user="user-a", password="pw-a"))
    try:
        a.put(RunKeys("run-a").root + "mine", "ok")  # its own prefix
        assert a.get(RunKeys("run-a").root + "mine").value == b"ok"
        for attempt in (lambda: a.get(key_of_b), lambda: a.put(key_of_b, "overwritten"),
                        lambda: a.delete(key_of_b), lambda: a.get_prefix("/eft/")):
            with pytest.raises(StoreError, match="permission denied"):
                attempt()
        assert root.get(key_of_b).value == b"b's"
    finally:
        a.close()
        root.close()


def test_a_client_logged_in_before_an_etcd_restart_goes_on_after_it(tmp_path):
    """etcd's simple tokens live in its memory: after a restart each request of a client that
    logged in before answered "invalid auth token", for ever (a job on a password would lose
    its leases, then every node). The client logs in again and goes on."""
    etcd = DeployedEtcd(tmp_path).start()
    try:
        etcd.enable_auth()
        etcd.add_run_user("user-a", "pw-a", RunKeys("run-a").root)
        client = connect(etcd.options(user="user-a", password="pw-a"))
        lease = client.lease(30)
        client.put(RunKeys("run-a").root + "k", "before", lease=lease)
        etcd.stop()
        etcd.start()
        client.put(RunKeys("run-a").root + "k", "after", lease=lease)
        assert client.get(RunKeys("run-a").root + "k").value == b"after"
        client.close()
    finally:
        etcd.stop()


@pytest.mark.slow
def test_eft_run_trains_with_its_runs_user_only(auth_etcd, tmp_path):
    """Everything eft-run writes lies under /eft/<run_id>/: a role of that prefix is enough."""
    result = run_eft(auth_etcd, "run-a", "user=user-a,password=pw-a", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "events.jsonl").exists()
    assert etcd_keys(auth_etcd, RunKeys("run-a").root)


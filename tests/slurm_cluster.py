"""A private one-host SLURM cluster for tests: munged, slurmctld and four slurmd.

The four nodes ``n1``..``n4`` are four slurmd processes on this host (``-N nX``, a
port each, all ``NodeHostname=localhost``), so multi-node jobs, ``srun`` steps,
signals, requeues and arrays behave as on a real cluster. Clients find the cluster
through ``SLURM_CONF`` in ``SlurmCluster.env``; nothing under /etc is touched.

    with SlurmCluster(tmp_dir) as cluster:
        job_id = cluster.sbatch(script, nodes=2, ntasks_per_node=1)
        info = cluster.wait(job_id, until={"COMPLETED"})

Needs root (slurmd runs jobs as their user and must own its spool) and the Debian
packages slurmctld, slurmd, slurm-client and munge. See docs/slurm-facts.md for
what this cluster showed about SLURM's behaviour.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Self

NODES = ("n1", "n2", "n3", "n4")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
# Ended states: the job will not run again unless requeued.
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE"})
# A requeued job waits the credential lifetime (AuthInfo cred_expire, default 120 s,
# at least 5) before it may start again: short here so requeue tests do not wait 2 min.
CRED_EXPIRE_S = 10


def unavailable_reason() -> str | None:
    """Why a SlurmCluster cannot run on this machine, or None when it can."""
    missing = [name for name in BINARIES if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if missing:
        return (f"SLURM not installed (missing {', '.join(missing)}; "
                "apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        return "a private SLURM cluster needs root (slurmd runs jobs as their user)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmError(RuntimeError):
    """A SLURM client command failed or a job did not reach the awaited state in time."""


class SlurmCluster:
    """A one-host cluster of nodes n1..n4 (CPUs=4 each), partition ``debug``; state under ``workdir``."""

    def __init__(self, workdir: str | Path, cpus_per_node: int = 4, kill_wait_s: int = 10,
                 cred_expire_s: int = CRED_EXPIRE_S):
        self.workdir = Path(workdir).resolve()
        self.cred_expire_s = cred_expire_s
        self.cpus_per_node = cpus_per_node
        self.kill_wait_s = kill_wait_s
        self.conf = self.workdir / "etc" / "slurm.conf"
        self.logs = self.workdir / "log"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        # Submitting from a test run inside a SLURM job must not inherit that job.
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":
                del self.env[key]
        self._daemons: list[subprocess.Popen] = []
        self._munge_socket = self.workdir / "munge" / "munge.sock"

    # -- life cycle -------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> Self:
        """Start munged, slurmctld and the slurmds; return once every node is idle."""
        try:
            self._write_config()
            self._start_munge()
            self._spawn([_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
            self._wait_for(lambda: self._run("scontrol", "ping", check=False).returncode == 0, timeout,
                           "slurmctld did not answer scontrol ping")
            for node in NODES:
                self._spawn([_binary("slurmd"), "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}.out")
            self._wait_for(self._all_nodes_idle, timeout, "nodes did not become idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every job, SIGKILL its processes, then end the daemons this cluster started."""
        daemons = {proc.pid for proc in self._daemons}
        if len(self._daemons) > 1 and self._daemons[1].poll() is None:  # slurmctld is up
            self._run("scancel", "--user=root", check=False)
            # scancel (even --signal=KILL) gives SIGTERM and waits KillWait before SIGKILL;
            # a teardown need not wait: kill the jobs' processes, slurmstepd then ends the job.
            self._kill_marked(spare=daemons, spare_stepd=True)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self._run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.2)
        for proc in reversed(self._daemons):  # slurmds, slurmctld, then munged
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._daemons:
            self._kill_marked(spare=set(), spare_stepd=False)
        self._daemons.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- jobs ----------------------------------------------------------------------------

    def sbatch(self, script: str | Path, *args, **opts) -> str:
        """Submit ``script args`` with ``opts`` as ``--key=value`` flags (``_`` -> ``-``; True: bare flag)."""
        flags = []
        for key, value in opts.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                flags.append(flag)
            elif value is not False and value is not None:
                flags.append(f"{flag}={value}")
        out = self._run("sbatch", "--parsable", *flags, str(script), *map(str, args)).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str | int) -> dict[str, str]:
        """``scontrol -o show job ID`` as a dict (JobState, ExitCode, Restarts, BatchHost, NodeList, StdOut...)."""
        jobs = self.jobs(job_id)
        if not jobs:
            raise SlurmError(f"no job {job_id}")
        return jobs[0]

    def jobs(self, job_id: str | int) -> list[dict[str, str]]:
        """Every record ``scontrol`` shows for ``job_id``: one per array task for an array job."""
        result = self._run("scontrol", "-o", "show", "job", str(job_id), check=False)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return []
            raise SlurmError(f"scontrol show job {job_id}: {result.stderr.strip()}")
        return [parse_job_line(line) for line in result.stdout.splitlines() if line.strip()]

    def wait(self, job_id: str | int, until: Iterable[str] | Callable[[dict], bool] = FINISHED,
             timeout: float = 60.0, interval: float = 0.2) -> dict[str, str]:
        """Poll the job until its JobState is in ``until`` (or ``until(job)`` is true); return the job."""
        if callable(until):
            done = until
        else:
            states = frozenset(until)
            def done(job):
                return job["JobState"] in states
        deadline = time.monotonic() + timeout
        job: dict = {}
        while time.monotonic() < deadline:
            jobs = self.jobs(job_id)
            if jobs:
                job = jobs[0]
                if done(job):
                    return job
            time.sleep(interval)
        raise SlurmError(f"job {job_id} not done after {timeout}s: {job.get('JobState')} {job.get('Reason')}")

    def scancel(self, job_id: str | int, *flags: str) -> None:
        """``scancel FLAGS JOB`` (e.g. ``"--signal=USR1", "--batch"``)."""
        self._run("scancel", *flags, str(job_id))

    def requeue(self, job_id: str | int) -> None:
        """``scontrol requeue JOB``."""
        self._run("scontrol", "requeue", str(job_id))

    def run(self, *cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a SLURM client command (squeue, sinfo...) against this cluster; return its output."""
        return self._run(*cmd, check=check, timeout=timeout)

    # -- internals -----------------------------------------------------------------------

    def _run(self, *cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        result = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise SlurmError(f"{shlex.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def _spawn(self, cmd: list[str], log_name: str) -> subprocess.Popen:
        with open(self.logs / log_name, "ab") as log:
            # Own session: stop() ends a daemon with everything it left behind.
            proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._daemons.append(proc)
        return proc

    def _start_munge(self) -> None:
        munge_dir = self._munge_socket.parent
        munge_dir.mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory that is not executable by all.
        munge_dir.chmod(0o711)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn([_binary("munged"), "-F", "-f", f"--key-file={key}", f"--socket={self._munge_socket}",
                     f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={self.logs / 'munged.log'}",
                     f"--seed-file={munge_dir / 'munged.seed'}"], "munged.out")
        self._wait_for(self._munge_socket.exists, 10, "munged did not create its socket")

    def _kill_marked(self, spare: set[int], spare_stepd: bool) -> None:
        # Jobs' processes and slurmstepd (own sessions, parent init, outliving slurmd) carry
        # this cluster's SLURM_CONF in their environment: that is how they are found. The
        # sessions in ``spare`` (the daemons' own, e.g. slurmctld's slurmscriptd) are kept.
        mark = f"SLURM_CONF={self.conf}".encode()
        for proc_dir in Path("/proc").glob("[0-9]*"):
            pid = int(proc_dir.name)
            try:
                environ = (proc_dir / "environ").read_bytes().split(b"\0")
                if pid == os.getpid() or os.getsid(pid) in spare or mark not in environ:
                    continue
                if spare_stepd and (proc_dir / "comm").read_text().strip() == "slurmstepd":
                    continue
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone, or not ours to read
                pass

    def _all_nodes_idle(self) -> bool:
        out = self._run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(node) == "idle" for node in NODES)

    def _wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p.args[0] for p in self._daemons if p.poll() is not None]
            if dead:
                raise SlurmError(f"{what}: {', '.join(map(str, dead))} exited; logs in {self.logs}")
            time.sleep(0.2)
        raise SlurmError(f"{what} within {timeout}s; logs in {self.logs}")

    def _write_config(self) -> None:
        for sub in ("etc", "log", "state", "munge", *(f"spool/{node}" for node in NODES)):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        (self.workdir / "etc" / "plugstack.conf").write_text("")
        w = self.workdir
        settings = {
            "ClusterName": "eft",
            "SlurmctldHost": "localhost",
            "SlurmctldPort": _free_port(),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self._munge_socket},cred_expire={self.cred_expire_s}",
            "StateSaveLocation": w / "state",
            "SlurmdSpoolDir": w / "spool" / "%n",
            "SlurmctldPidFile": w / "slurmctld.pid",
            "SlurmdPidFile": w / "spool" / "slurmd-%n.pid",
            "SlurmctldLogFile": self.logs / "slurmctld.log",
            "SlurmdLogFile": self.logs / "slurmd-%n.log",
            "PlugStackConfig": w / "etc" / "plugstack.conf",
            "ProctrackType": "proctrack/linuxproc",  # no cgroups in containers
            "TaskPlugin": "task/none",
            "MpiDefault": "none",
            "SwitchType": "switch/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "SchedulerType": "sched/builtin",
            "SchedulerParameters": "sched_interval=1,sched_min_interval=0",
            "SlurmdParameters": "config_overrides",  # nodes claim more CPUs/memory than the host has
            "JobRequeue": 1,
            "MinJobAge": 3600,  # finished jobs stay visible to scontrol show job
            "KillWait": self.kill_wait_s,
            "OverTimeLimit": 0,
            "InactiveLimit": 0,
            "ReturnToService": 2,
            "SlurmdTimeout": 300,
            "SlurmctldTimeout": 300,
            "MessageTimeout": 10,
            "JobCompType": "jobcomp/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
        }
        lines = [f"{key}={value}" for key, value in settings.items()]
        for node in NODES:
            lines.append(f"NodeName={node} NodeHostname=localhost Port={_free_port()} CPUs={self.cpus_per_node} "
                         f"RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")


def parse_job_line(line: str) -> dict[str, str]:
    """One line of ``scontrol -o show job`` as a dict (a word without ``=`` continues the last value)."""
    job: dict[str, str] = {}
    key = None
    for word in line.split(" "):
        name, eq, value = word.partition("=")
        if eq and name:
            key = name
            job[key] = value
        elif key is not None:  # a value with a space in it (e.g. Command=, Comment=)
            job[key] += " " + word
    return job

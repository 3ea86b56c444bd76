"""Warm workers (``--eft-warm-workers``): interpreters started ahead of need become the workers.

A cold worker start pays for a fresh interpreter and its imports (torch and megatron-core: 4 s
on this machine, 14 s on a GPU node) at every restart, on every GPU of the job. The pool keeps
one idle interpreter per local rank that already imported them (``worker/warm_interpreter.py``);
torch still starts the workers (its ``SubprocessContext``, log files, error files, exit codes),
but each worker's process is taken from the pool: ``WarmHandler._popen`` hands an idle
interpreter the worker's environment, command and stdout/stderr instead of forking a new one.
The interpreter answers whether it runs the command warm or, on doubt, cold in its own place;
one line in the agent's log says which. With no live interpreter at hand the start is torch's own.

When interpreters are started: at the agent's start (they import while the rendezvous forms),
right after each start of the workers (replacing those that became workers), and when an idle
one died. They import under ``SCHED_IDLE`` (``warm_interpreter.py``): only CPU time nothing else
wants, so a refill never slows the workers that just started. Only from the agent's main thread:
the death signal that ties an interpreter to its agent comes when the *thread* that forked it
ends (``orphans.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elasticft import torch_seam
from elasticft.agent.orphans import unguarded_command
from elasticft.config import StartConfig
from elasticft.contract.warm_start import (WARM, Handoff, PythonCommand, Spawn, ignored_signals, parse_python_command,
                                           slot_environment, with_watched_site)

log = logging.getLogger(__name__)

MODULE = "elasticft.worker.warm_interpreter"
# First on an interpreter's PYTHONPATH: its sitecustomize watches what the site's own setup reads.
WATCHED_SITE_DIR = str(Path(__file__).resolve().parents[1] / "boot" / "warm")
CHECK_IDLE_EVERY = 1.0  # seconds between looks at the idle interpreters (one that died is replaced)
EARLY_DEATHS_TO_GIVE_UP = 3  # interpreters in a row that died before use: warm workers off


@dataclass
class WarmInterpreter:
    proc: subprocess.Popen
    control: socket.socket
    command: PythonCommand
    capture: list[str]  # its stdout and stderr files until a handoff
    slot: int  # the local rank it was started for (its LOCAL_RANK)

    def last_line(self) -> str:
        """The last line it printed to stderr (an import error, say), for the log."""
        try:
            lines = Path(self.capture[1]).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return f": {lines[-1]}" if lines else ""

    def discard(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.control.close()
        self.proc.wait()


class WarmPool:
    def __init__(self, config: StartConfig, run_dir: Path, die_with_agent: bool):
        self._config = config
        self._dir = Path(run_dir) / "warm"
        self._die_with_agent = die_with_agent
        self._idle: list[WarmInterpreter] = []
        self._answers: list[tuple[int, WarmInterpreter]] = []  # handed off, answer not read yet
        self._command: PythonCommand | None = None
        self._size = 0
        self._spawned = 0
        self._early_deaths = 0
        self._next_check = 0.0  # monotonic

    # -- standing ready -------------------------------------------------------------

    def stand_ready(self, entrypoint, args, size: int) -> None:
        """Have ``size`` interpreters ready for ``entrypoint args`` (main thread)."""
        if not self._config.warm_workers:
            return
        command = parse_python_command(str(entrypoint), tuple(args)) if isinstance(entrypoint, str) else \
            "the entrypoint is a Python function"
        if isinstance(command, str):
            log.info("warm workers off for this command: %s", command)
            self.close()
            self._command = None
            return
        self._command, self._size = command, size
        self._fill()

    def _fill(self) -> None:
        if self._command is None or threading.current_thread() is not threading.main_thread():
            return
        for warm in [w for w in self._idle if w.proc.poll() is not None]:
            self._idle.remove(warm)
            log.warning("%s%s; %s", self._retire(warm), warm.last_line(), "replacing it"
                        if self._early_deaths < EARLY_DEATHS_TO_GIVE_UP
                        else f"warm workers off: {self._early_deaths} died in a row")
        if self._early_deaths >= EARLY_DEATHS_TO_GIVE_UP:
            return
        ready = {warm.slot for warm in self._idle}
        self._idle += [self._spawn(self._command, slot) for slot in range(self._size) if slot not in ready]

    def _spawn(self, command: PythonCommand, slot: int) -> WarmInterpreter:
        """An interpreter for local rank ``slot``: the site's setup sees what a cold start of that
        rank's worker sees of the environment before the round (``contract.warm_start.SLOT_VARIABLES``)."""
        self._dir.mkdir(parents=True, exist_ok=True)
        number, self._spawned = self._spawned, self._spawned + 1
        capture = [str(self._dir / f"{number}.out"), str(self._dir / f"{number}.err")]
        modules, auto = self._config.preload_modules()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spawn = Spawn(command, modules, auto, capture, os.getpid(), self._die_with_agent)
        env = {**os.environ, **slot_environment(slot, self._size)}  # what torch gives a worker, not the C library's
        if not {"-E", "-I"} & set(command.options):  # PYTHONPATH is read: the site setup can be watched
            env = with_watched_site(env, WATCHED_SITE_DIR)
        with open(capture[0], "wb") as out, open(capture[1], "wb") as err:
            proc = subprocess.Popen(
                [command.python, *command.options, "-m", MODULE, str(theirs.fileno()), spawn.encode()],
                pass_fds=(theirs.fileno(),), stdout=out, stderr=err, start_new_session=True, env=env)
        theirs.close()
        return WarmInterpreter(proc, ours, command, capture, slot)

    def _retire(self, warm: WarmInterpreter) -> str:
        """Forget an interpreter that died while idle (counted: too many in a row turn warm
        workers off); what happened to it."""
        self._early_deaths += 1
        warm.control.close()
        return f"the warm interpreter pid {warm.proc.pid} died while idle (exit {warm.proc.returncode})"

    # -- a start of the workers -----------------------------------------------------

    @contextlib.contextmanager
    def handlers(self):
        """For one start of the workers: torch builds their processes from the pool; then the
        pool is filled again for the next start."""
        if not self._config.warm_workers:
            yield
            return
        with torch_seam.subprocess_handlers(self._handler):
            yield
        self._fill()

    def _handler(self, **kwargs):
        return WarmHandler(self, **kwargs)

    def start(self, argv: tuple, env: dict[str, str], per_rank: set[str], stdout, stderr,
              local_rank: int) -> subprocess.Popen | None:
        """The worker's process from an idle interpreter; None: start it cold (torch's way)."""
        program, args = unguarded_command(argv)
        if self._command is None:
            return None
        why = "no warm interpreter ready"
        while mine := [w for w in self._idle if w.slot == local_rank]:  # started with this LOCAL_RANK
            warm = mine[0]
            self._idle.remove(warm)
            if warm.proc.poll() is not None:
                why = self._retire(warm)
                continue
            _normal_priority(warm.proc.pid)  # a worker waits on it now, even if it is still importing
            handoff = Handoff(program, [str(a) for a in args], dict(env), os.getcwd(), sorted(per_rank), time.time(),
                              ignored_signals())
            fds = [(stdout or sys.stdout).fileno(), (stderr or sys.stderr).fileno()]
            try:
                socket.send_fds(warm.control, [handoff.encode()], fds)
            except OSError as exc:  # it died a moment ago
                log.info("local rank %d: warm interpreter pid %d is gone (%s)", local_rank, warm.proc.pid, exc)
                warm.discard()
                continue
            self._early_deaths = 0
            self._answers.append((local_rank, warm))
            return warm.proc
        log.info("local rank %d: cold start (%s)", local_rank, why)
        return None

    # -- between starts ---------------------------------------------------------------

    def tick(self) -> None:
        """From the agent's monitor loop: log the answers; replace an idle interpreter that died."""
        if self._command is None:
            return
        self._read_answers()
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + CHECK_IDLE_EVERY
            self._fill()

    def _read_answers(self) -> None:
        for item in list(self._answers):
            local_rank, warm = item
            try:
                line = warm.control.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                line = b""
            self._answers.remove(item)
            warm.control.close()
            answer = line.decode(errors="replace").strip()
            if answer == WARM:
                log.info("local rank %d: warm start in pid %d", local_rank, warm.proc.pid)
            elif answer:
                log.info("local rank %d: cold start in pid %d, in the warm interpreter's place: %s",
                         local_rank, warm.proc.pid, answer.removeprefix("cold: "))
            else:
                log.info("local rank %d: pid %d ended before it said warm or cold", local_rank, warm.proc.pid)

    def close(self) -> None:
        """Idle interpreters end (the workers they became are torch's)."""
        self._read_answers()
        for warm in self._idle:
            warm.discard()
        self._idle = []


def _normal_priority(pid: int) -> None:
    """Every thread of ``pid`` back from ``SCHED_IDLE`` (threads keep their own policy: one left
    idle would starve on a busy node, and even the process's exit waits for it)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in threads:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except (OSError, ValueError, AttributeError):
            pass


class WarmHandler(torch_seam.subprocess_handler_class()):
    """torch's SubprocessHandler whose process comes from the pool when it can."""

    def __init__(self, pool: WarmPool, *, entrypoint, args, env, stdout, stderr, local_rank_id, numa_options):
        self._pool = pool
        self._per_rank = set(env)
        super().__init__(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)

    def _popen(self, args, env):
        proc = self._pool.start(tuple(args), env, self._per_rank, self._stdout, self._stderr, self.local_rank_id)
        return proc if proc is not None else super()._popen(args, env)

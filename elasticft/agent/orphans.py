"""No orphans: workers die with their agent, even when the agent is SIGKILLed.

torch starts every worker in a session of its own (``Popen(start_new_session=True)``)
and stops them itself when the agent ends; an agent killed by SIGKILL stops nothing,
and its workers keep their GPU and ports until some collective happens to fail. So each
worker starts through ``pdeathsig_exec.py``, which sets ``PR_SET_PDEATHSIG=SIGKILL`` and
execs the real command: the kernel kills the worker when its agent dies.

torch's Popen has no pre-exec hook (and ``preexec_fn`` is unsafe in a process with
threads), hence a shim in front of the command, put there for one start of the workers
and taken away after it: the planner rewrites ``spec.args`` at every start, and torch's
events name the spec's entrypoint.

Threads: the death signal comes when the *thread* that forked the worker ends, not its
process. torch forks the workers synchronously from its run loop (``run`` ->
``_invoke_run`` -> ``_initialize_workers``/``_restart_workers`` -> ``_start_workers``),
eft's own restarts happen in that loop (``_monitor_workers``), and eft-run runs the agent
on its main thread (torchrun's ``run`` -> ``launch_agent`` -> ``agent.run``). The main
thread ends only with the process, so the signal means "the agent died". Should a start
ever come from another thread, its workers go unguarded (with a warning): the signal
would kill healthy workers when that thread ends.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import select
import shutil
import sys
import threading
import time
from collections.abc import Collection, Iterator

from torch.distributed.elastic.agent.server.api import WorkerSpec

from elasticft import pdeathsig_exec

log = logging.getLogger(__name__)

SHIM = os.path.abspath(pdeathsig_exec.__file__)
# Seconds to wait for killed helpers to be gone (a SIGKILLed process goes at once unless
# stuck in the kernel, e.g. in a GPU driver call; then the restart goes on without it).
HELPERS_GONE_TIMEOUT = 5.0


@functools.cache
def death_signal_supported() -> bool:
    """Linux, with a libc whose prctl the shim can call; said once when not."""
    if not sys.platform.startswith("linux"):
        log.warning("workers may outlive a killed agent: PR_SET_PDEATHSIG is Linux-only")
        return False
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl  # noqa: B018 - the lookup is the check
    except (OSError, AttributeError) as exc:
        log.warning("workers may outlive a killed agent: no prctl in libc.so.6 (%s)", exc)
        return False
    return True


@functools.cache
def _warn_off_main_thread() -> None:
    log.warning("workers started off the agent's main thread are not tied to the agent "
                "(PR_SET_PDEATHSIG follows the forking thread); they may outlive a killed agent")


def guarded_command(entrypoint: str, args: tuple, agent_pid: int) -> tuple[str, tuple]:
    """The entrypoint and arguments that run ``entrypoint args`` through the shim."""
    program, *shim_args = pdeathsig_exec.command(agent_pid, (entrypoint, *args))
    return program, tuple(shim_args)


def unguarded_command(argv: tuple) -> tuple[str, tuple]:
    """The program and arguments of a command ``guarded_command`` may have put the shim in front of."""
    prefix = tuple(pdeathsig_exec.shim_command())
    if tuple(argv[:len(prefix)]) == prefix and len(argv) > len(prefix) + 1:
        return argv[len(prefix) + 1], tuple(argv[len(prefix) + 2:])
    return argv[0], tuple(argv[1:])


@contextlib.contextmanager
def workers_die_with_agent(spec: WorkerSpec, enabled: bool) -> Iterator[None]:
    """For one start of ``spec``'s workers: run each through the shim.

    Left as it is: a callable entrypoint (torch runs it in a multiprocessing child, no
    command to put a shim in front of), and a program not on PATH (torch's own error,
    as under torchrun, rather than the shim's exit status 127 taken for a failed worker).
    """
    entrypoint = spec.entrypoint
    if not enabled or not isinstance(entrypoint, str) or shutil.which(entrypoint) is None:
        yield
        return
    if not death_signal_supported():
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        _warn_off_main_thread()
        yield
        return
    args = spec.args
    spec.entrypoint, spec.args = guarded_command(entrypoint, args, os.getpid())
    try:
        yield
    finally:
        spec.entrypoint, spec.args = entrypoint, args


def kill_sessions(sessions: Collection[int]) -> list:
    """SIGKILL what is left in the workers' sessions once they are stopped; the processes killed.

    torch starts each worker in a session of its own (its pid is the session id), and
    whatever a worker starts stays in that session even after the worker dies and its
    children are re-parented to init: a torch_dist save's spawn helpers (a results
    Manager, a resource tracker), dataloader workers. ``PR_SET_PDEATHSIG`` on the worker
    does not reach them, and on a GPU they can hold device or pinned memory. Call it when
    the workers are gone (a restart, the end): a helper that left the session (setsid)
    is out of reach, as it would be of torchrun.
    """
    import psutil

    ended = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and os.getsid(process.pid) in sessions:
                process.kill()
                ended.append(process)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            pass
    return ended


def helpers_exited(ended: Collection) -> None:
    """Wait (bounded) until the processes ``kill_sessions`` killed have exited: what they held
    (memory, a GPU) is free for the next generation. Exited, not reaped (``wait_exited``): their
    parent is init, or a container's PID 1, which reaps when it gets round to it (every 1.5 s
    on a Firecracker VM) or never; waiting for that was a restart's whole ``stop`` phase."""
    if not ended:
        return
    stuck = wait_exited(ended, HELPERS_GONE_TIMEOUT)
    log.info("ended %d process(es) the workers left behind: %s", len(ended), ", ".join(str(p.pid) for p in ended))
    if stuck:
        log.warning("%d killed process(es) still running after %g s (stuck in the kernel?): %s; going on",
                    len(stuck), HELPERS_GONE_TIMEOUT, ", ".join(str(p.pid) for p in stuck))


def wait_exited(processes: Collection, timeout: float) -> list:
    """Wait until every one of ``processes`` (psutil.Process) has exited; those still running after
    ``timeout`` seconds.

    Exited, not reaped: a zombie has released its memory, files and devices and waits only for
    its parent to collect its status, which for an orphan is init's business, not the agent's.
    The exits are awaited all at once on pidfds (readable when the process exits, Linux >= 5.3),
    so the wait ends with the last exit, whatever the number of processes; where a pidfd cannot
    be had, the process's state is looked at, more and more rarely (up to every 40 ms).
    """
    watched: dict[int, object] = {}  # pidfd -> process
    looked_at = []  # no pidfd: their state is read
    poller = select.poll()
    for process in processes:
        try:
            fd = os.pidfd_open(process.pid)
        except ProcessLookupError:
            continue  # reaped already
        except (OSError, AttributeError):  # an old kernel or Python, or no file descriptor left
            looked_at.append(process)
            continue
        if not process.is_running():  # the pid was reaped and reused before the pidfd was had: ours is gone
            os.close(fd)
            continue
        watched[fd] = process
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    interval = 0.001
    try:
        while watched or looked_at:
            looked_at = [p for p in looked_at if not _exited(p)]
            left = deadline - time.monotonic()
            if left <= 0 or not (watched or looked_at):
                break
            wait = min(left, interval) if looked_at else left
            for fd, _ in poller.poll(max(1, math.ceil(wait * 1000))):
                poller.unregister(fd)
                os.close(fd)
                watched.pop(fd)
            interval = min(interval * 2, 0.04)
    finally:
        for fd in watched:
            os.close(fd)
    return [*watched.values(), *looked_at]


def _exited(process) -> bool:
    import psutil

    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True

"""A worker interpreter started ahead of need: imports done, then it waits to become a worker.

``python [the job's options] -m elasticft.worker.warm_interpreter FD SPAWN`` (started by the
agent's ``WarmPool``, in a session of its own as torch starts workers). It dies with its agent
(``PR_SET_PDEATHSIG``, as ``elasticft/pdeathsig_exec.py`` does for a cold worker), puts on
``sys.path`` what a cold start of the job's command would, and imports the heavy modules. Then
it waits on the socket FD for a ``Handoff``: the worker's environment, command, working
directory, and its stdout and stderr as descriptors. It answers one line and becomes the worker:

* **warm**: the environment replaced, ``sys.argv`` and ``sys.path[0]`` as a cold start has them,
  the script run as ``__main__`` (``-m``: ``runpy.run_module``, as the interpreter does);
* **cold**, on any doubt: it ``exec``\\ s the command in place, so the worker is exactly a cold
  start (the same pid, the death signal kept). Doubt is: a preloaded module failed to import,
  a variable other than eft's and torch's per-rank ones changed since this interpreter started
  (it may have been read at import), a per-rank one that the site setup (``boot/warm/``) or the
  preload read had another value then (only the slot's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are
  known ahead: ``RANK`` is not), a module file it loaded changed on disk (code updated between
  restarts), or a command other than the one it was started for.

What it must not do before the handoff: anything that depends on the rank: no process group,
no CUDA context (importing torch makes none), no threads of its own, no signal handlers.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import os
import signal
import socket
import sys
import types

from elasticft.contract.run_dir import WorkerEnv
from elasticft.contract.warm_start import (SLOT_VARIABLES, Handoff, Spawn, changed_variables, parse_python_command,
                                           read_too_early, reply_line, without_watched_site)
from elasticft.worker import environ_reads
from elasticft.worker.opening_imports import auto_preload
from elasticft.pdeathsig_exec import die_with

MAX_HANDOFF = 1 << 22  # bytes of one handoff message (the environment dominates)


def _import_when_idle() -> None:
    """Import on CPU time nothing else wants (``SCHED_IDLE``), so that a refill never slows the
    workers that just started; the agent puts every thread back to the normal policy before the
    handoff (``WarmPool.start``: allowed unprivileged)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def entry_file(spawn: Spawn) -> str | None:
    command = spawn.command
    if command.script is not None:
        return command.script if os.path.isfile(command.script) else None
    import importlib.util

    try:
        spec = importlib.util.find_spec(command.module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def modules_to_preload(spawn: Spawn) -> list[tuple[str, bool]]:
    """(module, optional): the names given, then ``auto``'s (``opening_imports``)."""
    modules = [(name, False) for name in spawn.modules]
    entry = entry_file(spawn) if spawn.auto else None
    if entry is not None:
        modules += auto_preload(entry)
    return list(dict.fromkeys(modules))


def preload(modules: list[tuple[str, bool]]) -> str | None:
    """Import ``modules``; why not, for the first that fails (the rest are left alone). An
    optional one (the script guards its import with ``except ImportError``) may be missing: its
    cold start would not have it either."""
    import importlib

    for name, optional in modules:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure means a cold start
            if optional and isinstance(exc, ImportError):
                continue
            return f"could not import {name}: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def loaded_files() -> dict[str, tuple[int, int]]:
    """Every module file this interpreter loaded, with its mtime and size."""
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            try:
                st = os.stat(path)
            except OSError:
                continue
            files[path] = (st.st_mtime_ns, st.st_size)
    return files


def changed_files(before: dict[str, tuple[int, int]]) -> list[str]:
    changed = []
    for path, mark in before.items():
        try:
            st = os.stat(path)
        except OSError:
            changed.append(path)
            continue
        if (st.st_mtime_ns, st.st_size) != mark:
            changed.append(path)
    return changed


def doubt(spawn: Spawn, handoff: Handoff, started_env: dict, import_error: str | None,
          files: dict[str, tuple[int, int]], reads: dict[str, str] | None) -> str | None:
    """Why this interpreter cannot be the worker a cold start would be (None: it can).
    ``reads``: the variables its site setup and preload read (None: a site setup ran unwatched)."""
    if import_error:
        return import_error
    if reads is None:
        return "a site setup ran unwatched (-E or -I): what it read of the worker's environment is not known"
    command = parse_python_command(handoff.program, handoff.args)
    if isinstance(command, str):
        return command
    mine = spawn.command
    if (command.python, command.options, command.module, command.script) != (
            mine.python, mine.options, mine.module, mine.script):
        return "the command is not the one this interpreter was started for"
    variables = changed_variables(started_env, handoff.env, {*handoff.per_rank, *SLOT_VARIABLES})
    if variables:
        return f"environment changed since it started: {', '.join(variables[:3])}" + (
            f" and {len(variables) - 3} more" if len(variables) > 3 else "")
    early = read_too_early(reads, started_env, handoff.env, set(handoff.per_rank))
    if early:
        return f"{early[0]} before the worker's environment existed" + (
            f" (and {len(early) - 1} more)" if len(early) > 1 else "")
    stale = changed_files(files)
    if stale:
        return f"a loaded module's file changed on disk: {stale[0]}" + (
            f" and {len(stale) - 1} more" if len(stale) > 1 else "")
    return None


def _take_output(spawn: Spawn, out_fd: int, err_fd: int) -> None:
    """Replay what the preload printed into the worker's streams, then make them fds 1 and 2."""
    for captured, fd, stream in ((spawn.capture[0], out_fd, sys.stdout), (spawn.capture[1], err_fd, sys.stderr)):
        stream.flush()
        try:
            with open(captured, "rb") as f:
                data = f.read()
            os.unlink(captured)
        except OSError:
            data = b""
        if data:
            os.write(fd, data)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)


# What Python itself ignores at every start, whatever it inherited.
_PYTHONS_OWN = {getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name)}


def _run_cold(handoff: Handoff) -> None:
    _signals_of_a_cold_start(handoff.ignored, before_exec=True)
    # The same pid goes on, and the kernel dates it at this interpreter's start, before the failure:
    # the worker's heartbeats date its start at the handoff instead (progress.process_started_at).
    env = {**handoff.env, WorkerEnv.BECAME_WORKER: f"{os.getpid()}:{handoff.sent_at!r}"}
    try:
        os.execvpe(handoff.program, [handoff.program, *handoff.args], env)
    except OSError as exc:
        print(f"eft: cannot run {handoff.program}: {exc}", file=sys.stderr)
        os._exit(127)


def given_environment() -> dict[str, str]:
    """The environment this interpreter was started with: what the agent gave it, less what the
    agent added to watch its site setup (``with_watched_site``). Not ``os.environ``, which the
    interpreter's own start may have changed before any of eft's code ran (a sitecustomize that
    imports torch: torch sets TORCHINDUCTOR_CACHE_DIR); Linux keeps the original in
    /proc/self/environ."""
    try:
        with open("/proc/self/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return without_watched_site(dict(os.environ))
    return without_watched_site(dict(os.fsdecode(item).split("=", 1) for item in items if b"=" in item))


def watch_the_preload() -> bool:
    """Watch the preload's reads as the site setup's were; False: a site setup ran unwatched
    (-E, -I: no PYTHONPATH, so no ``boot/warm`` sitecustomize before it)."""
    site = sys.modules.get("sitecustomize")
    if getattr(site, "_eft_watched_site", False):
        del sys.modules["sitecustomize"]  # the site has none of its own: a cold start has none either
    watched = environ_reads.watching() or not any(m in sys.modules for m in ("sitecustomize", "usercustomize"))
    environ_reads.watch("a preloaded module")
    return watched


def own_changes(given: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """What this interpreter's start and imports set and removed in its environment: a cold
    start's site and imports would do the same, so the worker keeps them."""
    now = dict(os.environ)
    return {k: v for k, v in now.items() if given.get(k) != v}, [k for k in given if k not in now]


def _signals_of_a_cold_start(ignored: list[int], before_exec: bool) -> None:
    """The signal dispositions torch's Popen would give a worker now: ignored what the agent
    ignores at the handoff (``ignored``), and no more. This interpreter inherited the agent's
    ignored signals of its own, earlier start (an agent started by a batch shell's ``&`` ignores
    SIGINT until torch installs its handlers). ``before_exec``: every other signal at its default
    (exec resets handlers, not ignores; SIGPIPE and SIGXFSZ too, as ``restore_signals=True``
    does); else, in this running interpreter, as Python sets up a signal it did not inherit ignored."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if sig in ignored and sig not in _PYTHONS_OWN:
                signal.signal(sig, signal.SIG_IGN)
            elif before_exec:
                signal.signal(sig, signal.SIG_DFL)
            elif sig not in _PYTHONS_OWN and signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        except (OSError, ValueError):
            continue


def _run_warm(handoff: Handoff, changes: tuple[dict[str, str], list[str]]) -> None:
    from elasticft.worker.progress import became_worker_at

    became_worker_at(handoff.sent_at)  # the worker's start, as the heartbeats tell it
    _signals_of_a_cold_start(handoff.ignored, before_exec=False)
    command = parse_python_command(handoff.program, handoff.args)
    set_here, removed_here = changes
    os.environ.clear()
    os.environ.update(handoff.env)
    os.environ.update(set_here)
    for name in removed_here:
        os.environ.pop(name, None)
    first = command.sys_path0(handoff.cwd)
    if first is not None:
        sys.path[0] = first
    sys.orig_argv = [handoff.program, *handoff.args]
    if command.module is not None:
        import runpy

        sys.argv = ["-m", *command.args]
        runpy.run_module(command.module, run_name="__main__", alter_sys=True)
        return
    # As the interpreter runs a script: a fresh __main__, __file__ absolute, argv[0] as given.
    sys.argv = [command.script, *command.args]
    path = os.path.abspath(command.script)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def main(argv: list[str]) -> None:
    control = socket.socket(fileno=int(argv[1]))
    spawn = Spawn.decode(argv[2])
    if spawn.die_with_agent:
        die_with(spawn.agent_pid)
    started_env = given_environment()
    site_watched = watch_the_preload()
    _import_when_idle()
    first = spawn.command.sys_path0(os.getcwd())
    if first is not None and sys.path:
        sys.path[0] = first
    import_error = preload(modules_to_preload(spawn))
    reads = environ_reads.stop()  # before own_changes reads the whole environment
    files, changes = loaded_files(), own_changes(started_env)
    message, fds, _flags, _addr = socket.recv_fds(control, MAX_HANDOFF, 2)
    if not message or len(fds) != 2:  # the agent closed the pool: nothing to become
        os._exit(0)
    handoff = Handoff.decode(message)
    why = doubt(spawn, handoff, started_env, import_error, files, reads if site_watched else None)
    os.chdir(handoff.cwd)
    _take_output(spawn, *fds)
    control.sendall(reply_line(why is None, why or ""))
    control.close()
    if why is not None:
        _run_cold(handoff)
    _run_warm(handoff, changes)


if __name__ == "__main__":
    main(sys.argv)

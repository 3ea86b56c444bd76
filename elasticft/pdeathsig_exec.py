"""Exec shim: die with the parent, then become the program.

Usage: python -I -S pdeathsig_exec.py PARENT_PID PROGRAM [ARGS...]

It asks the kernel to SIGKILL this process when the thread that forked it ends
(``PR_SET_PDEATHSIG``), makes sure that thread's process (``PARENT_PID``) did not die
before that took effect, and ``execvp``\\ s PROGRAM. The death signal survives execve, and
the pid stays. Two parents put it in front of their children:

- the agent, in front of each worker (``agent/orphans.py``): torch starts each worker with
  ``Popen([PROGRAM, *ARGS])``, so the worker's pid is torch's and its ``sys.argv`` the one
  torchrun would give it;
- the launcher and the tests, in front of an embedded etcd (``store/server.py``).

Why a shim and not ``Popen(preexec_fn=...)``: preexec_fn runs Python in the forked child
of a process with threads (gRPC's, torch's); a lock one of them held at the fork stays
held in the child, which can hang or crash there (an etcd child segfaulted so, once).

Run by path with the standard library only (no eft import, no site): it costs one bare
interpreter start per child.
"""

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# -I -S: a bare interpreter (no site, no PYTHON* variables) starts fastest and imports
# nothing of the job's; the shim needs only the standard library.
INTERPRETER_FLAGS = ("-I", "-S")


def shim_command() -> list:
    """The interpreter and this file: what ``command`` puts before the parent's pid."""
    return [sys.executable, *INTERPRETER_FLAGS, os.path.abspath(__file__)]


def command(parent_pid: int, argv) -> list:
    """The command that runs ``argv`` through this shim, SIGKILLed when ``parent_pid``'s
    forking thread ends."""
    return [*shim_command(), str(parent_pid), *argv]


def die_with(parent_pid: int) -> None:
    """SIGKILL this process when the thread that forked it ends; at once if ``parent_pid`` is
    already gone (it died between the fork and this call: the signal would never come).
    Raises OSError where prctl fails. Also called by a warm interpreter (``worker/warm_interpreter.py``)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _starting_environment() -> dict:
    """The environment this process was started with.

    The interpreter running this shim may have added to its own (PEP 538 sets
    LC_CTYPE=C.UTF-8 under the C locale); the worker must get torch's, unchanged.
    /proc/self/environ still shows the block execve was given.
    """
    try:
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except OSError:
        return dict(os.environ)
    env = {}
    for entry in block.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env


def main(argv: list) -> None:
    parent_pid, program = int(argv[1]), argv[2]
    try:
        die_with(parent_pid)
    except (OSError, AttributeError) as exc:  # the parent checked prctl works: not expected
        print(f"eft: {program} not tied to its parent ({exc}); it may outlive a killed parent", file=sys.stderr)
    # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec:
    # give the program the dispositions Popen(restore_signals=True) gives it (torchrun's workers).
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvpe(program, argv[2:], _starting_environment())
    except OSError as exc:
        print(f"eft: cannot run {program}: {exc}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv)

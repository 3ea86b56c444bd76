"""A warm worker interpreter and its agent: what they say to each other, and the rules both apply.

With ``--eft-warm-workers`` the agent keeps idle Python interpreters that already imported
the job's heavy modules (``elasticft.worker.warm_interpreter``); a start of the workers hands
one of them a ``Handoff`` over a Unix socket, with the worker's stdout and stderr as file
descriptors, and the interpreter answers with one ``Reply`` line: it runs the entrypoint
itself (warm) or, on any doubt, execs the command in place (a cold start, same pid).

The rules live here because both sides need them: the agent reads a command to decide
whether a warm interpreter can run it at all, the interpreter reads it again to run it.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass, field

# Interpreter options a warm interpreter can be started with, as a cold start would be: they
# take effect at start-up, so the warm one is started with the very same ones. Anything else
# (-c, -X with a value we cannot compare, an unknown option) means the command is run cold.
PLAIN_OPTIONS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-b", "-bb", "-q", "-R", "-P"})
VALUE_OPTIONS = frozenset({"-W", "-X"})
# eft's own variables carry the generation's settings to the worker's hook, read when the hook
# starts, never at import: they may change between the warm interpreter's start and its use.
GENERATION_PREFIX = "EFT_"
WARM = "warm"


@dataclass(frozen=True)
class PythonCommand:
    """``python [options] (-m module | script) [args]``: a command a warm interpreter can take."""

    python: str
    options: tuple[str, ...]
    module: str | None  # -m's module, else None
    script: str | None  # the script's path, else None
    args: tuple[str, ...]

    def sys_path0(self, cwd: str) -> str | None:
        """The entry a cold start puts first on ``sys.path``: the script's real directory, or the
        working directory for ``-m``; none under -I or -P."""
        if "-I" in self.options or "-P" in self.options:
            return None
        return os.path.dirname(os.path.realpath(self.script)) if self.script is not None else cwd


def parse_python_command(program: str, args: tuple | list) -> PythonCommand | str:
    """The command as a ``PythonCommand``, or why a warm interpreter cannot run it (a str)."""
    if not os.path.basename(program).startswith("python"):
        return f"{program} is not a Python interpreter (--no-python)"
    args = [str(a) for a in args]
    options: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        arg = args[i]
        if arg == "-m":
            if i + 1 >= len(args):
                return "-m without a module"
            return PythonCommand(program, tuple(options), args[i + 1], None, tuple(args[i + 2:]))
        if arg in PLAIN_OPTIONS:
            options.append(arg)
        elif arg in VALUE_OPTIONS and i + 1 < len(args):
            options += [arg, args[i + 1]]
            i += 1
        else:
            return f"interpreter option {arg} is not one a warm interpreter takes"
        i += 1
    if i >= len(args) or args[i] == "-":
        return "no script to run"
    return PythonCommand(program, tuple(options), None, args[i], tuple(args[i + 1:]))


def changed_variables(started: dict[str, str], given: dict[str, str], per_rank: set[str]) -> list[str]:
    """Variables whose value differs between the warm interpreter's start and the worker's
    environment, other than eft's own and torch's per-rank ones: any of them may have been
    read at import, so the warm interpreter is not the one a cold start would be."""
    names = set(started) | set(given)
    return sorted(n for n in names if started.get(n) != given.get(n)
                  and not n.startswith(GENERATION_PREFIX) and n not in per_rank)


def ignored_signals() -> list[int]:
    """The signals this process ignores now (what a child it starts inherits as ignored)."""
    found = []
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                found.append(int(sig))
        except (OSError, ValueError):  # not a signal Python can ask about
            continue
    return found


@dataclass(frozen=True)
class Handoff:
    """What the agent sends to start one worker (stdout and stderr go with it as descriptors)."""

    program: str
    args: list[str]  # after the program, as torch would pass them to Popen
    env: dict[str, str]  # the worker's whole environment
    cwd: str
    per_rank: list[str] = field(default_factory=list)  # torch's per-rank variables (may differ)
    sent_at: float = 0.0  # unix time: the worker's start (it may still be importing then)
    # signals the agent ignores at the handoff: a cold worker inherits exactly those ignored (an
    # interpreter started earlier, e.g. before torch's handlers, may have inherited others)
    ignored: list[int] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, data: bytes) -> "Handoff":
        return cls(**json.loads(data))


def reply_line(warm: bool, why: str = "") -> bytes:
    """The interpreter's answer: ``warm``, or ``cold: <why>``."""
    return (WARM if warm else f"cold: {why}").encode() + b"\n"


@dataclass(frozen=True)
class Spawn:
    """What a warm interpreter is started with (one JSON argument): the command it stands ready
    for, the modules to import ahead of need, and where its own output goes until a handoff."""

    command: PythonCommand
    modules: list[str]  # named by --eft-preload
    auto: bool  # also the entry's top-level imports (--eft-preload auto)
    capture: list[str]  # the files its stdout and stderr go to until the handoff (replayed then)
    agent_pid: int
    die_with_agent: bool

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> "Spawn":
        data = json.loads(text)
        data["command"] = PythonCommand(**{k: tuple(v) if isinstance(v, list) else v
                                           for k, v in data["command"].items()})
        return cls(**data)


# What is known of a worker slot (a local rank) before its worker exists, and is the same at every
# restart: a warm interpreter is started with these, so that the site's setup sees them as the cold
# worker's would. torch's other worker variables (RANK, GROUP_RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT, TORCHELASTIC_RESTART_COUNT, the error file) come with the round: not known yet and
# never faked; an interpreter whose site setup or preload read one of them starts its worker cold.
SLOT_VARIABLES = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")


def slot_environment(local_rank: int, local_world_size: int) -> dict[str, str]:
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size)}


# A warm interpreter starts with elasticft/boot/warm/ first on its PYTHONPATH: its sitecustomize
# watches which variables the site's own setup reads (worker/environ_reads.py). This variable holds
# the PYTHONPATH the command has without it (JSON, null: unset); that sitecustomize puts it back
# before the site's setup runs, and the interpreter reads its start-up environment through it.
WATCHED_SITE = "EFT_WARM_SITE"


def with_watched_site(env: dict[str, str], site_dir: str) -> dict[str, str]:
    original = env.get("PYTHONPATH")
    path = os.pathsep.join(filter(None, [site_dir, original]))
    return {**env, WATCHED_SITE: json.dumps(original), "PYTHONPATH": path}


def without_watched_site(env: dict[str, str]) -> dict[str, str]:
    """``env`` as the command has it: what ``with_watched_site`` added taken away."""
    env = dict(env)
    if WATCHED_SITE not in env:
        return env
    original = json.loads(env.pop(WATCHED_SITE))
    if original is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = original
    return env


def read_too_early(reads: dict[str, str], started: dict[str, str], given: dict[str, str], per_rank: set[str]) -> list[str]:
    """``who read NAME`` for each of torch's per-rank variables (and the slot's) read before the
    handoff (``reads``: name -> who) whose value then (``started``) is not the worker's (``given``):
    the setup did not see what a cold start's sees. The other variables need no reading:
    ``changed_variables`` holds any change of them against the interpreter."""
    judged = {*per_rank, *SLOT_VARIABLES}
    return [f"{who} read {name}" for name, who in sorted(reads.items())
            if name in judged and started.get(name) != given.get(name)]

"""Warm workers (--eft-warm-workers): a worker that starts in an interpreter started ahead of
need is the worker a cold start would be, and any doubt ends in a cold start, said in one line."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from elasticft.agent.warm_pool import WarmPool
from elasticft.config import StartConfig
from elasticft.contract.warm_start import changed_variables, parse_python_command

# What a worker can see of how it was started; the run differs only in the run's own values.
DUMP = textwrap.dedent('''
    import json, os, signal, sys, time
    import __main__
    import json as heavy  # stands for torch: a top-level import of an installed package
    import helper_beside  # the script's own module: never preloaded
    attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    record = {
        "argv": sys.argv, "orig_argv": sys.orig_argv, "path0": sys.path[0], "cwd": os.getcwd(),
        "env": dict(os.environ), "ppid": os.getppid(), "session_leader": os.getsid(0) == os.getpid(),
        "name": __name__, "file": __file__, "main_file": __main__.__file__, "flags": list(sys.flags),
        "signals": {n: str(signal.getsignal(getattr(signal, n))) for n in ("SIGTERM", "SIGINT", "SIGPIPE", "SIGUSR1")},
        "loader": type(__main__.__loader__).__name__, "helper_loaded_by": helper_beside.LOADED_BY,
    }
    dump = os.path.join(os.environ["DUMP_DIR"], f"{attempt}-{rank}.json")
    with open(dump + ".part", "w") as f:
        json.dump(record, f)
    os.replace(dump + ".part", dump)
    print(f"out {rank} {attempt}")
    print(f"err {rank} {attempt}", file=sys.stderr)
    if attempt == "0" and rank == "1":
        # Not before rank 0 has written its dump: the agent stops rank 0 when rank 1 dies,
        # and a slow start (a loaded machine) would otherwise lose it.
        while not os.path.exists(os.path.join(os.environ["DUMP_DIR"], "0-0.json")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == "0":
        signal.pause()  # until the agent stops this generation
    sys.exit(0)
''')
# Values that belong to one run (ids, ports, temporary directories, the agent's pid), not to how
# a worker was started.
PER_RUN = {"TORCHELASTIC_ERROR_FILE", "EFT_START_TIME", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "EFT_RUN_ID",
           "EFT_ENDPOINT", "EFT_RUN_DIR", "EFT_NODE_ID"}


def _job(tmp_path: Path, name: str, *flags: str) -> tuple[subprocess.CompletedProcess, dict, dict, int]:
    folder = tmp_path / name
    (folder / "dump").mkdir(parents=True)
    (folder / "job").mkdir()
    (folder / "job" / "train.py").write_text(DUMP)
    (folder / "job" / "helper_beside.py").write_text("import os\nLOADED_BY = os.environ.get('RANK')\n")
    # Started as a batch shell's `cmd &` starts it: SIGINT ignored until torch installs its handlers.
    agent = subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh", sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--log-dir", str(folder / "logs"), "--redirects", "3", *flags, "job/train.py", "--lr", "0.1"],
        cwd=folder, env={**os.environ, "DUMP_DIR": "dump", "PYTHONPATH": str(Path.cwd())},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = agent.communicate(timeout=120)
    dumps = {p.stem: json.loads(p.read_text().replace(str(folder), "<job folder>"))
             for p in (folder / "dump").glob("*.json")}
    logs = {str(p.relative_to(folder / "logs")).split("/", 1)[1]: p.read_text()
            for p in (folder / "logs").rglob("*.log")}
    return subprocess.CompletedProcess(agent.args, agent.returncode, output), dumps, logs, agent.pid


@pytest.mark.seam
@pytest.mark.slow
def test_a_warm_worker_is_the_worker_a_cold_start_would_be(tmp_path):
    cold, cold_dumps, cold_logs, cold_agent = _job(tmp_path, "cold")
    warm, warm_dumps, warm_logs, warm_agent = _job(tmp_path, "warm", "--eft-warm-workers")
    assert cold.returncode == warm.returncode == 0, warm.stdout[-3000:]
    # Two generations (rank 1 killed in the first), both started warm, one line per worker.
    assert sorted(re.findall(r"local rank (\d): warm start in pid", warm.stdout)) == ["0", "0", "1", "1"], warm.stdout
    assert "warm start" not in cold.stdout
    assert sorted(cold_dumps) == sorted(warm_dumps) == ["0-0", "0-1", "1-0", "1-1"]
    for key, c in cold_dumps.items():
        w = warm_dumps[key]
        differing = {n for n in set(c["env"]) | set(w["env"]) if c["env"].get(n) != w["env"].get(n)}
        assert differing <= PER_RUN, (key, {n: (c["env"].get(n), w["env"].get(n)) for n in differing - PER_RUN})
        assert (c.pop("ppid"), w.pop("ppid")) == (cold_agent, warm_agent)  # the worker's parent is its agent
        c.pop("env"), w.pop("env")
        assert c == w, key
        assert w["cwd"] == "<job folder>" and w["path0"] == "<job folder>/job" and w["argv"] == ["job/train.py", "--lr", "0.1"] and w["session_leader"] and w["helper_loaded_by"] == key[-1]
    # The same log files per rank and attempt, with the same lines.
    assert cold_logs == warm_logs and cold_logs["attempt_1/1/stderr.log"] == "err 1 1\n"


# -- doubt, one case at a time, on a real pool and real interpreters -------------------------


@pytest.fixture
def script(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "preloaded_mod.py").write_text("VERSION = 1\n")
    path = tmp_path / "job.py"
    path.write_text("import os, sys\nimport preloaded_mod\n"
                    "print('version', preloaded_mod.VERSION, 'pid', os.getpid(), 'foo', os.environ.get('FOO'))\n"
                    "sys.exit(int(os.environ.get('EXIT', '0')))\n")
    return path


def _pool(tmp_path, preload="auto") -> WarmPool:
    pool = WarmPool(StartConfig(warm_workers=True, preload=preload), tmp_path / "run", die_with_agent=True)
    return pool


def _start(pool: WarmPool, script: Path, tmp_path: Path, env: dict, caplog) -> tuple[int, str, str]:
    """One worker started through the pool, as torch's handler would: (exit code, stdout, log line)."""
    out, err = open(tmp_path / "w.out", "w+"), open(tmp_path / "w.err", "w+")  # noqa: SIM115
    argv = (sys.executable, "-u", str(script))
    with pool.handlers():  # as the agent's start of the workers: the pool is filled again after it
        proc = pool.start(argv, env, {"RANK", "EXIT"}, out, err, 0)  # torch's per-rank variables
        if proc is None:  # torch's own start
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, start_new_session=True)
    code = proc.wait(timeout=60)
    with caplog.at_level(logging.INFO, logger="elasticft.agent.warm_pool"):
        pool.tick()
    out.seek(0), err.seek(0)
    lines = [r.getMessage() for r in caplog.records if "start" in r.getMessage()]
    caplog.clear()
    return code, out.read() + err.read(), (lines or [""])[-1]


def _ready(pool: WarmPool, script: Path, tmp_path: Path) -> dict:
    """The agent's environment (the interpreters start with it); a worker's is it and its own."""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "lib"), str(Path.cwd())])
    pool.stand_ready(sys.executable, ("-u", str(script)), 1)
    return dict(os.environ)


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_warm_start_runs_the_script_with_its_exit_status_and_refills(script, tmp_path, caplog):
    pool = _pool(tmp_path)
    env = _ready(pool, script, tmp_path)
    code, out, line = _start(pool, script, tmp_path, {**env, "EXIT": "3", "EFT_TP": "2"}, caplog)
    assert code == 3 and "version 1" in out and re.fullmatch(r"local rank 0: warm start in pid \d+", line)
    assert f"pid {line.split()[-1]}" in out  # the pid the agent was given is the worker's
    assert len(pool._idle) == 1  # a replacement stands ready
    pool.close()


def test_an_idle_interpreter_killed_is_a_cold_start_and_is_replaced(script, tmp_path, caplog):
    pool = _pool(tmp_path)
    env = _ready(pool, script, tmp_path)
    (idle,) = pool._idle
    os.kill(idle.proc.pid, signal.SIGKILL)
    idle.proc.wait()
    with caplog.at_level(logging.INFO, logger="elasticft.agent.warm_pool"):
        code, out, line = _start(pool, script, tmp_path, env, caplog)
    assert code == 0 and "version 1" in out
    assert line == f"local rank 0: cold start (the warm interpreter pid {idle.proc.pid} died while idle (exit -9))"
    assert len(pool._idle) == 1 and pool._idle[0].proc.poll() is None  # replaced
    code, out, line = _start(pool, script, tmp_path, env, caplog)
    assert code == 0 and "version 1" in out and "warm start" in line
    pool.close()


def test_a_changed_environment_or_module_file_is_a_cold_start_in_place(script, tmp_path, caplog):
    pool = _pool(tmp_path)
    env = _ready(pool, script, tmp_path)
    code, out, line = _start(pool, script, tmp_path, {**env, "FOO": "bar"}, caplog)
    assert code == 0 and "foo bar" in out
    assert line.endswith("in the warm interpreter's place: environment changed since it started: FOO"), line
    pid = re.search(r"in pid (\d+)", line)[1]
    assert f"pid {pid} " in out  # exec'd in place: the same pid
    (tmp_path / "lib" / "preloaded_mod.py").write_text("VERSION = 2  # updated between restarts\n")
    code, out, line = _start(pool, script, tmp_path, env, caplog)
    assert "version 2" in out and "a loaded module's file changed on disk" in line and "preloaded_mod.py" in line
    pool.close()


def test_what_the_interpreters_own_start_sets_is_no_doubt_and_a_cold_start_in_place_is_dated_at_the_handoff(
        tmp_path, caplog):
    # A site's own setup that writes a variable (as torch does when a sitecustomize imports it).
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "sitecustomize.py").write_text("import os\nos.environ['SET_BY_SITE'] = str(os.getpid())\n")
    script = tmp_path / "job.py"
    script.write_text("import os\nfrom elasticft.worker.progress import process_started_at\n"
                      "print('site', os.environ.get('SET_BY_SITE') == str(os.getpid()), 'started', process_started_at())\n")
    pool = _pool(tmp_path)
    env = _ready(pool, script, tmp_path)
    code, out, line = _start(pool, script, tmp_path, env, caplog)
    assert code == 0 and re.fullmatch(r"local rank 0: warm start in pid \d+", line), line
    assert "site True" in out  # the worker keeps what its own start set, as a cold one would have it
    (idle,) = pool._idle
    handed = time.time()
    assert idle.proc.poll() is None and handed > psutil.Process(idle.proc.pid).create_time()
    code, out, line = _start(pool, script, tmp_path, {**env, "FOO": "bar"}, caplog)
    assert code == 0 and "in the warm interpreter's place" in line and "site True" in out, line
    # eft report dates this worker's start at the handoff, not at the interpreter's own start
    assert float(out.split("started ")[1].split()[0]) >= handed
    pool.close()


def test_an_import_error_in_a_preloaded_module_is_a_cold_start_with_the_users_error(script, tmp_path, caplog):
    (tmp_path / "lib" / "broken_mod.py").write_text("raise RuntimeError('broken at import')\n")
    pool = _pool(tmp_path, preload="auto,broken_mod")
    env = _ready(pool, script, tmp_path)
    code, out, line = _start(pool, script, tmp_path, env, caplog)
    assert code == 0 and "version 1" in out  # the script itself never imports it: it runs as it would cold
    assert line.endswith("could not import broken_mod: RuntimeError: broken at import"), line
    pool.close()


def test_commands_a_warm_interpreter_cannot_take_are_named():
    assert parse_python_command("/opt/bin/train", ["--x"]).endswith("(--no-python)")
    assert "-c" in parse_python_command(sys.executable, ["-c", "print(1)"])
    command = parse_python_command(sys.executable, ["-u", "-X", "dev", "-m", "pkg.mod", "--lr", "1"])
    assert (command.options, command.module, command.args) == (("-u", "-X", "dev"), "pkg.mod", ("--lr", "1"))
    assert changed_variables({"A": "1", "EFT_TP": "1", "RANK": "0"}, {"A": "2", "EFT_TP": "2", "RANK": "1"},
                             {"RANK"}) == ["A"]


def test_auto_preloads_the_opening_imports_of_installed_packages_only(tmp_path):
    from elasticft.worker.opening_imports import auto_preload

    (tmp_path / "own_module.py").write_text("import decimal\n\ndef build():\n    return decimal.Decimal(1)\n")
    script = tmp_path / "train.py"
    script.write_text('"""doc"""\nfrom __future__ import annotations\nimport os, json\n'
                      "try:\n    import csv\nexcept ImportError:\n    csv = None\n"
                      "from email import message\nimport own_module\nimport zipfile\nfrom . import sibling\nimport uuid\n")
    # The script's own module is read, not run: its imports come where Python would import them.
    assert auto_preload(str(script)) == [("os", False), ("json", False), ("csv", True), ("email", False),
                                         ("decimal", False), ("zipfile", False)]
    script.write_text("import os\nos.environ['X'] = '1'  # may change what the next import does\nimport json\n")
    assert auto_preload(str(script)) == [("os", False)]


def test_an_optional_import_the_script_guards_may_be_missing_without_a_cold_start():
    from elasticft.worker.warm_interpreter import preload

    assert preload([("eft_no_such_module", True), ("json", False)]) is None  # its cold start would skip it too
    assert preload([("eft_no_such_module", False)]).startswith("could not import eft_no_such_module:")


# In the shape of NVIDIA's pretrain_gpt.py (core_v0.19.0): a timestamp before the heavy imports,
# a model builder of its own beside it (importing megatron), more megatron, an optional import.
NVIDIA_SHAPED = textwrap.dedent('''
    """Pretrain a model."""

    import time
    _PROGRAM_START_TIME = time.time()

    import json
    import os
    import sys
    import warnings
    from functools import partial

    if int(os.environ.get("RANK", "0")) != 0:  # one rank shows library warnings
        for _category in (UserWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=_category)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    import torch

    from builders import build
    from megatron.core import parallel_state
    try:
        from megatron.post_training import arguments
    except ImportError:
        arguments = None

    stimer = build()
    import zipfile
''')
BUILDERS = "import megatron.core.models.gpt  # the model\nfrom megatron.training import get_args\n\n\ndef build():\n    return get_args\n"


@pytest.mark.parametrize("before, stops", [
    ("", False),
    ("os.environ['CUDA_DEVICE_MAX_CONNECTIONS'] = '1'", True),  # read by an import
    ("sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))", True),  # another folder
    ("warnings.filterwarnings('error')", True),  # an import-time warning would fail the import
    ("torch_setup()", True),  # a call eft does not know
    ("class Config:\n    seed: int = 1\n    def name(self) -> str:\n        return setup()", False),
    ("class Config:\n    seed = setup()  # a class body runs at its definition", True),
], ids=["as-is", "environ-write", "parent-on-path", "warnings-as-errors", "unknown-call", "class", "class-calls"])
def test_auto_reads_past_what_cannot_change_an_import_and_into_the_scripts_own_modules(tmp_path, before, stops):
    from elasticft.worker.opening_imports import auto_preload

    (tmp_path / "builders.py").write_text(BUILDERS)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(NVIDIA_SHAPED.replace("import torch\n", f"{before}\nimport torch\n"))
    opening = ["time", "json", "os", "sys", "warnings", "functools"]
    heavy = ["torch", "megatron.core.models.gpt", "megatron.training", "megatron.core", "megatron.post_training"]
    preloaded = auto_preload(str(script))
    assert [name for name, _ in preloaded] == opening + ([] if stops else heavy)
    assert [name for name, optional in preloaded if optional] == ([] if stops else ["megatron.post_training"])


def test_a_module_run_with_m_and_a_program_that_is_not_python(tmp_path, caplog):
    (tmp_path / "lib" / "pkg").mkdir(parents=True)
    (tmp_path / "lib" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "lib" / "pkg" / "main.py").write_text("import sys\nprint('argv0', sys.argv[0], sys.argv[1:])\n"
                                                      "raise SystemExit(5)\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "lib"), str(Path.cwd())])
    pool = _pool(tmp_path)
    pool.stand_ready(sys.executable, ("-u", "-m", "pkg.main", "--x"), 1)
    out = open(tmp_path / "m.out", "w+")  # noqa: SIM115
    with caplog.at_level(logging.INFO, logger="elasticft.agent.warm_pool"):
        proc = pool.start((sys.executable, "-u", "-m", "pkg.main", "--x"), dict(os.environ), set(), out, out, 0)
        assert proc.wait(timeout=60) == 5
        pool.tick()
    out.seek(0)
    assert out.read() == f"argv0 {tmp_path / 'lib' / 'pkg' / 'main.py'} ['--x']\n"  # as python -m sets it
    assert any(re.fullmatch(r"local rank 0: warm start in pid \d+", r.getMessage()) for r in caplog.records)
    pool.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="elasticft.agent.warm_pool"):
        pool.stand_ready("/bin/echo", ("hello",), 1)
        assert pool.start(("/bin/echo", "hello"), dict(os.environ), set(), None, None, 0) is None  # torch's own start
    assert [r.getMessage() for r in caplog.records] == [
        "warm workers off for this command: /bin/echo is not a Python interpreter (--no-python)"]


AGENT = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    from elasticft.agent.warm_pool import WarmPool
    from elasticft.config import StartConfig
    pool = WarmPool(StartConfig(warm_workers=True), Path(sys.argv[1]), die_with_agent=True)
    pool.stand_ready(sys.executable, ("-u", sys.argv[2]), 2)
    worker = pool.start((sys.executable, "-u", sys.argv[2]), dict(os.environ), set(), None, None, 0)
    print(worker.pid, pool._idle[0].proc.pid, flush=True)
    time.sleep(600)
''')


def test_warm_interpreters_and_the_workers_they_became_die_with_a_killed_agent(tmp_path):
    import psutil

    (tmp_path / "sleeper.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    (tmp_path / "agent.py").write_text(AGENT)
    agent = subprocess.Popen([sys.executable, str(tmp_path / "agent.py"), str(tmp_path / "run"),
                              str(tmp_path / "sleeper.py")], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in agent.stdout.readline().split()]
    processes = [psutil.Process(p) for p in pids]
    agent.kill()  # SIGKILL: nothing of the agent's runs to stop them
    agent.wait()
    gone, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"outlived their agent: {alive}"


@pytest.mark.slow
def test_an_nvidia_shaped_script_restarts_warm_with_no_preload_flag(tmp_path):
    """bench/restart_toy.py opens as NVIDIA's pretrain_gpt.py does (a timestamp, torch, a builder
    of its own that imports megatron-core, more megatron-core): with --eft-warm-workers alone, the
    restart after a SIGKILLed rank finds its imports done; eft report's imports phase of the
    restart is under a tenth of the job's cold start's."""
    from elasticft.contract.phases import RestartPhase
    from elasticft.goodput.breakdown import breakdown

    root = Path(__file__).resolve().parents[1]
    events = tmp_path / "events.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.1", "--eft-events-file", str(events), "--eft-warm-workers",
         "--eft-inject", "rank_killed:1@5", str(root / "bench" / "restart_toy.py"), "12"],
        cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(re.findall(r"local rank \d: warm start in pid", done.stdout + done.stderr)) == 4
    report = breakdown([json.loads(line) for line in events.read_text().splitlines() if line.strip()])
    (failure,) = report.failures

    def imports(spans) -> float:
        return sum(span.seconds for span in spans if span.name == RestartPhase.IMPORTS)

    cold, warm = imports(report.start_phases), imports(failure.phases)
    print(f"imports: the job's start {cold:.2f} s, the warm restart {warm:.2f} s")
    assert cold > 0 and warm < 0.1 * cold

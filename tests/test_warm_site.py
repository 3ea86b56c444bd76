"""Warm = cold under a site's own setup: a ``sitecustomize`` that reads the worker's slot at
import (a per-rank device or NUMA binding, a CPU emulation) sees in a warm interpreter what it
sees in a cold start; one that reads what is not known before the worker exists (``RANK``) makes
the worker start cold, said in one line that names it."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elasticft.agent.warm_pool import WarmPool
from elasticft.config import StartConfig

# A site's setup that binds each local rank to its own device, as a cluster's sitecustomize does.
BINDING = ("import os\n"
           "os.environ['SITE_SAW'] = f\"{os.environ.get('LOCAL_RANK')}/{os.environ.get('LOCAL_WORLD_SIZE')}\"\n"
           "os.environ['BOUND_TO'] = 'device' + os.environ.get('LOCAL_RANK', 'none')\n")
SCRIPT = "import os\nprint('site saw', os.environ.get('SITE_SAW'), 'bound to', os.environ.get('BOUND_TO'))\n"
PER_RANK = {"RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"}  # as torch gives them


@pytest.fixture
def job(tmp_path):
    """(the site's setup file, the script); the agent's environment is ``os.environ`` (the test's
    phase is in it: read it in the test)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "job.py").write_text(SCRIPT)
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "lib"), str(Path.cwd())])
    yield tmp_path / "lib" / "sitecustomize.py", tmp_path / "job.py"
    os.environ.clear()
    os.environ.update(saved)


def _worker_env(agent_env: dict, local_rank: int) -> dict:
    return {**agent_env, "RANK": str(10 + local_rank), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2",
            "WORLD_SIZE": "4"}


def _warm(pool: WarmPool, script: Path, tmp_path: Path, env: dict, local_rank: int, caplog) -> tuple[str, str]:
    """One worker started through the pool as torch's handler starts it: (its output, the agent's line)."""
    out = open(tmp_path / f"w{local_rank}.out", "w+")  # noqa: SIM115
    with pool.handlers():
        proc = pool.start((sys.executable, str(script)), env, PER_RANK, out, out, local_rank)
    assert proc is not None and proc.wait(timeout=60) == 0
    with caplog.at_level(logging.INFO, logger="elasticft.agent.warm_pool"):
        pool.tick()
    out.seek(0)
    lines = [r.getMessage() for r in caplog.records if "start" in r.getMessage()]
    caplog.clear()
    return out.read(), lines[-1]


def _cold(script: Path, env: dict) -> str:
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True).stdout


def test_a_site_setup_that_reads_the_local_rank_sees_in_a_warm_start_what_it_sees_in_a_cold_one(job, tmp_path, caplog):
    site, script = job
    site.write_text(BINDING)
    pool = WarmPool(StartConfig(warm_workers=True), tmp_path / "run", die_with_agent=True)
    pool.stand_ready(sys.executable, (str(script),), 2)
    for local_rank in (1, 0):
        env = _worker_env(dict(os.environ), local_rank)
        out, line = _warm(pool, script, tmp_path, env, local_rank, caplog)
        assert re.fullmatch(rf"local rank {local_rank}: warm start in pid \d+", line), line
        assert out == _cold(script, env) == f"site saw {local_rank}/2 bound to device{local_rank}\n"
    pool.close()


@pytest.mark.parametrize("where", ["site", "preload"])
def test_a_variable_not_known_before_the_worker_read_at_import_is_a_cold_start_that_names_it(job, tmp_path, caplog,
                                                                                           where):
    site, script = job
    reader = "import os\nos.environ['SITE_SAW'] = str(os.environ.get('RANK'))\n"  # known after the round only
    if where == "site":
        site.write_text(reader)
    else:
        (tmp_path / "lib" / "reads_rank.py").write_text(reader)
    pool = WarmPool(StartConfig(warm_workers=True, preload="auto" if where == "site" else "auto,reads_rank"),
                    tmp_path / "run", die_with_agent=True)
    pool.stand_ready(sys.executable, (str(script),), 1)
    env = _worker_env(dict(os.environ), 0)
    out, line = _warm(pool, script, tmp_path, env, 0, caplog)
    who = "the site setup" if where == "site" else "a preloaded module"
    assert re.fullmatch(rf"local rank 0: cold start in pid \d+, in the warm interpreter's place: {who} read RANK "
                        r"before the worker's environment existed", line), line
    if where == "site":  # run cold, the setup saw the worker's own RANK
        assert out == _cold(script, env) == "site saw 10 bound to None\n"
    pool.close()


# A worker that writes what the site's setup saw; local rank 1 is killed in the first generation.
RESTARTED = """
import json, os, signal, sys, time
attempt, local_rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
dump = os.path.join(os.environ["DUMP_DIR"], f"{attempt}-{local_rank}.json")
with open(dump + ".part", "w") as f:
    json.dump({"local_rank": local_rank, "site_saw": os.environ.get("SITE_SAW"), "bound": os.environ.get("BOUND_TO")}, f)
os.replace(dump + ".part", dump)
if attempt == "0":
    if local_rank == "1":
        while not os.path.exists(os.path.join(os.environ["DUMP_DIR"], "0-0.json")):
            time.sleep(0.01)  # until local rank 0 has said what it saw: the agent then stops it
        os.kill(os.getpid(), signal.SIGKILL)
    signal.pause()  # until the agent stops this generation
"""


@pytest.mark.slow
def test_a_restart_under_a_site_setup_of_the_users_is_warm_and_the_setup_sees_each_workers_slot(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "sitecustomize.py").write_text(BINDING)
    (tmp_path / "train.py").write_text(RESTARTED)
    (tmp_path / "dump").mkdir()
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.1", "--eft-warm-workers", str(tmp_path / "train.py")],
        cwd=root, capture_output=True, text=True, timeout=180,
        env={**os.environ, "DUMP_DIR": str(tmp_path / "dump"), "PYTHONPATH": f"{tmp_path / 'lib'}{os.pathsep}{root}"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert sorted(re.findall(r"local rank (\d): warm start in pid", output)) == ["0", "0", "1", "1"], output[-3000:]
    seen = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "dump").glob("*.json")}
    assert sorted(seen) == ["0-0", "0-1", "1-0", "1-1"]
    for record in seen.values():  # what a cold start's setup sees: the worker's own slot
        assert (record["site_saw"], record["bound"]) == (f"{record['local_rank']}/2", f"device{record['local_rank']}")


def test_the_gpt_example_declares_its_heavy_imports_and_a_warm_interpreter_makes_them_with_no_flag(tmp_path, caplog):
    from elasticft.worker.opening_imports import auto_preload

    example = Path(__file__).resolve().parents[1] / "examples" / "gpt3" / "train.py"
    assert ("gpt_preload", False) in auto_preload(str(example))  # megatron-core, after CPU mode
    # A script whose heavy import is inside a function, declared: warm, it is done before the handoff.
    (tmp_path / "heavy_beside.py").write_text("import decimal\n")
    script = tmp_path / "job.py"
    script.write_text("import sys\n__eft_preload__ = ('heavy_beside',)\n\n\ndef main():\n    import heavy_beside\n\n\n"
                      "print('preloaded', 'heavy_beside' in sys.modules)\nmain()\n")
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = str(Path.cwd())
    try:
        pool = WarmPool(StartConfig(warm_workers=True), tmp_path / "run", die_with_agent=True)
        pool.stand_ready(sys.executable, (str(script),), 1)
        out, line = _warm(pool, script, tmp_path, _worker_env(dict(os.environ), 0), 0, caplog)
        pool.close()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert re.fullmatch(r"local rank 0: warm start in pid \d+", line) and out == "preloaded True\n", (line, out)

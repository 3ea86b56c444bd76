"""What a new user trips over first, each as the command they would type: a misspelled script,
workers that fail for good, `eft status` / `eft ckpt` on a node of a running job with no flags,
a mistyped --rdzv-endpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.launch import WORKERS, eft_run, wait_for
from elasticft.contract.local_runs import LocalRuns
from elasticft.store import EmbeddedEtcd, free_port

# A shell of the user's own: none of a job's variables that would name a run for them.
USER_ENV = {k: v for k, v in os.environ.items() if k not in ("EFT_ENDPOINT", "EFT_RUN_ID") and not k.startswith("SLURM")}


def launch(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*eft_run(), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=USER_ENV)


def eft(*args: str, runs_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**USER_ENV, "EFT_RUNS_DIR": str(runs_dir)})


@pytest.mark.parametrize("entry, named", [
    (["nosuch.py"], "training script nosuch.py: no such file"),
    (["-m", "nosuch_package.train"], "-m nosuch_package.train: no module"),
    (["-m", "json.nosuch"], "-m json.nosuch: no module"),  # the package exists, the module does not
    (["--no-python", "nosuch-command"], "nosuch-command: no such command"),
])
def test_a_training_script_that_is_not_there_is_one_line_before_anything_starts(tmp_path, entry, named):
    started = time.monotonic()
    done = launch(["--standalone", "--nproc-per-node", "1", *entry], cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"eft-run: error: {done.stderr.split('error: ', 1)[1].strip()}"]
    assert named in done.stderr
    assert "embedded etcd" not in done.stderr and "Traceback" not in done.stderr  # nothing started
    assert time.monotonic() - started < 30


def test_a_module_in_the_working_directory_is_found_as_python_m_finds_it(tmp_path):
    package = tmp_path / "mytrain"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('a package import must not run in the launcher')\n")
    (package / "main.py").write_text("import os; print('trained', os.environ['RANK'])\n")
    done = launch(["--standalone", "--nproc-per-node", "1", "-m", "mytrain.main"], cwd=tmp_path)
    assert done.returncode == 1  # the package's __init__ ran in the worker, not in the launcher
    assert "a package import must not run in the launcher" in done.stdout + done.stderr
    (package / "__init__.py").write_text("")
    done = launch(["--standalone", "--nproc-per-node", "1", "-m", "mytrain.main"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "trained 0" in done.stdout


def test_workers_that_fail_for_good_end_with_torchs_summary_and_no_launcher_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys; sys.exit(3)\n")
    done = launch(["--standalone", "--nproc-per-node", "1", "--max-restarts", "0", str(script)], cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    summary = done.stderr[done.stderr.index("eft-run: error: the workers failed"):]
    assert f"{script} FAILED" in summary and "Root Cause (first observed failure)" in summary, summary
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)", summary) and re.search(r"exitcode\s*: 3 ", summary), summary


def test_on_a_node_of_a_running_job_eft_status_and_ckpt_find_it_without_flags(tmp_path, eft_job):
    runs_dir, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    assert "give --endpoint and --run-id" in eft("status", runs_dir=runs_dir).stderr  # no job yet
    job = eft_job("allreduce_loop.py", out, standalone=True, env={"EFT_RUNS_DIR": str(runs_dir)})
    wait_for(lambda: (out / "starts.jsonl").exists(), 90, "the worker to start")
    (run,) = LocalRuns(runs_dir).live()
    status = eft("status", runs_dir=runs_dir)
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"run {run.run_id}: ")
    saved = eft("ckpt", "save", runs_dir=runs_dir)
    assert saved.returncode == 0 and saved.stdout.startswith("requested "), saved.stderr
    assert "manual from eft ckpt" in eft("ckpt", "status", "--rdzv-id", run.run_id, runs_dir=runs_dir).stdout

    # A second job on this host (this test's own process, noted as eft-run notes its run): no guess.
    other = LocalRuns(runs_dir).register("other-run", "127.0.0.1:1", "/eft")
    try:
        both = eft("status", runs_dir=runs_dir)
        assert both.returncode == 2 and both.stderr.count("\n") == 1, both.stderr
        assert run.run_id in both.stderr and "other-run" in both.stderr and "--run-id" in both.stderr
        assert eft("status", "--rdzv-id", run.run_id, runs_dir=runs_dir).returncode == 0
    finally:
        other.unlink()
    (out / "finish").touch()
    assert job.wait(60) == 0, job.output()
    assert LocalRuns(runs_dir).live() == [] and not list(runs_dir.glob("*.json"))  # the launcher took its note


def test_a_launcher_killed_without_a_word_leaves_no_run_to_find(tmp_path):
    runs_dir = tmp_path / "runs"
    note = [sys.executable, "-c", "import sys; from elasticft.contract.local_runs import LocalRuns; "
                                  "LocalRuns(sys.argv[1]).register('gone', '127.0.0.1:1', '/eft')", str(runs_dir)]
    subprocess.run(note, check=True, timeout=60)  # its process ended without taking its note
    assert len(list(runs_dir.glob("*.json"))) == 1
    done = eft("ckpt", "save", runs_dir=runs_dir)
    assert done.returncode == 2 and "no eft-run is running on this host" in done.stderr, done.stderr
    assert not list(runs_dir.glob("*.json"))


def test_a_mistyped_endpoint_says_at_once_that_it_is_the_first_contact_and_when_it_gives_up(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    done = launch(["--nnodes", "1", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", "x", "--rdzv-conf",
                   "join_timeout=4", str(WORKERS / "env_probe.py"), str(tmp_path)], cwd=tmp_path)
    assert done.returncode == 2
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert warnings and "first contact" in warnings[0] and endpoint in warnings[0], done.stderr
    assert "giving up at" in warnings[0] and "join_timeout" in warnings[0]
    assert not [line for line in warnings if "unreachable" in line]  # not an outage of an etcd that answered
    assert done.stderr.strip().splitlines()[-1].startswith(f"eft-run: error: --rdzv-endpoint: no etcd answered at {endpoint}")


def test_a_busy_etcd_is_waited_for_and_a_frozen_one_is_one_line_after_etcd_timeout(tmp_path):
    """The etcd of a saving job can take seconds to answer (its log's fsync behind the job's
    writes): `eft ckpt` waits for it (--etcd-timeout, 30 s) instead of calling it unreachable
    after 5 s, as it once did in the middle of a run; an etcd that stays silent is one line."""
    with EmbeddedEtcd() as server:
        where = ["--endpoint", server.endpoint, "--run-id", "busy"]
        os.kill(server.pid, signal.SIGSTOP)
        try:
            busy = subprocess.Popen([sys.executable, "-m", "launcher.cli", "ckpt", "status", *where],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=USER_ENV)
            time.sleep(6.0)  # the fault: etcd silent for longer than the old 5 s
            assert busy.poll() is None, busy.communicate()
            silent = eft("ckpt", "status", *where, "--etcd-timeout", "1", runs_dir=tmp_path)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        out, err = busy.communicate(timeout=60)
        assert busy.returncode == 0, err
        assert "request: none" in out
    assert silent.returncode == 2
    assert silent.stderr.splitlines() == [f"eft ckpt: etcd at {server.endpoint} is unreachable"]


AGENT = ("import sys\nfrom elasticft.contract.local_runs import LocalRuns\n"
         "LocalRuns(sys.argv[1]).register(*sys.argv[2:5])\nprint(flush=True)\nsys.stdin.read()")


def test_two_agents_of_one_run_on_this_host_are_one_run_and_run_id_alone_reaches_it(tmp_path, etcd_server):
    """Two eft-run of one run on one host (the README's demo, two launchers a node) each note the
    run: the commands reach it with no flag and with --run-id alone; beside a second run, each run
    is listed once, with its agents, in one line."""
    runs_dir = tmp_path / "runs"
    notes = [("demo", etcd_server.endpoint, "/eft"), ("demo", etcd_server.endpoint, "/eft")]
    agents = []

    def note(run_id, endpoint, prefix):  # a launcher's note, from a process that stays alive
        agent = subprocess.Popen([sys.executable, "-c", AGENT, str(runs_dir), run_id, endpoint, prefix],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        agents.append(agent)
        agent.stdout.readline()

    try:
        for n in notes:
            note(*n)
        for where in ((), ("--run-id", "demo")):
            for command in (("ckpt", "status"), ("metrics", "targets")):
                reached = eft(*command, *where, runs_dir=runs_dir)
                assert reached.returncode == 0, (command, where, reached.stderr)
            # no agent in etcd here: status says it looked at the run's own etcd
            assert f"no run 'demo' under /eft/demo/ at {etcd_server.endpoint}" in eft(
                "status", *where, runs_dir=runs_dir).stderr
        note("other", "127.0.0.1:1", "/eft")
        both = eft("status", runs_dir=runs_dir)
        assert both.returncode == 2 and both.stderr.count("\n") == 1, both.stderr
        assert both.stderr.count("demo (") == 1 and "2 agents" in both.stderr and "other (" in both.stderr
        assert eft("ckpt", "status", "--run-id", "demo", runs_dir=runs_dir).returncode == 0
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()

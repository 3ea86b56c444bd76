"""bench/gpu_check.sh's steps on a job while it runs (eft top --once, eft ckpt save), and
Megatron-LM's own loop with a worker killed and resumed from memory. Run through
bench/gpu_check_steps.py, which holds the shared parts."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_steps import EMBEDDED, ITERS, KILL_AT, ROOT, Step, gpt_command, report_figures, run_job
from launch import Launched, eft_run, read_jsonl, wait_for

REQUEST = re.compile(r"(\w+): every rank saves")


def _endpoint(log: Path) -> tuple[str, str] | None:
    found = EMBEDDED.search(log.read_text(errors="replace")) if log.exists() else None
    return (found.group(1), found.group(2)) if found else None


def _alive(job: Launched, what: str):
    """A wait's condition that fails at once when the job has ended (not after its timeout)."""
    if job.proc.poll() is not None:
        raise SystemExit(f"the job exited {job.proc.returncode} while waiting for {what}")


def _top(step: Step, target: list[str], job: Launched) -> tuple[str, float]:
    """eft top --once on the running job, once a health sample of every GPU has reached etcd."""
    def frame():
        _alive(job, "a health sample in etcd")
        done = step.eft("top", "--once", "--json", *target, timeout=60)
        view = json.loads(done.stdout) if done.returncode == 0 else None
        return view if view and view["gpus"] else None

    started = time.monotonic()
    view = wait_for(frame, 90, "eft top --once with GPU rows", interval=2)
    text = step.eft("top", "--once", *target, env={"COLUMNS": "110"})
    step.detail("top", "eft top --once on the running job", text.stdout or text.stderr)
    header = view["header"]
    gpus = "; ".join(f"{g['node']} GPU {g['gpu']}: risk {g['risk']:.2f}, {g['temperature_c']}°C, "
                     f"{g['power_w']} W, util {g['utilization_pct']} %, memory {g['memory_used_mib']} MiB"
                     for g in view["gpus"])
    return (f"state {header['state']}, world {header['world_size']} (TP{header['tp']}×PP{header['pp']}×"
            f"DP{header['dp']}), {len(view['gpus'])} GPU row(s): {gpus}"), time.monotonic() - started


def _save(step: Step, target: list[str], job: Launched, train_log: Path) -> tuple[str, float]:
    """eft ckpt save on the running job: every rank saves the next iteration; the agent's ack."""
    started = time.monotonic()
    done = step.eft("ckpt", "save", *target)
    found = REQUEST.search(done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"eft ckpt save exited {done.returncode}")

    def acked():
        _alive(job, "the checkpoint's ack")
        status = step.eft("ckpt", "status", *target, "--json")
        acks = json.loads(status.stdout)["acks"] if status.returncode == 0 else []
        return next((a for a in acks if a["request_id"] == found.group(1)), None)

    ack = wait_for(acked, 120, f"the ack of request {found.group(1)}", interval=1)
    seconds = time.monotonic() - started
    saves = [r for r in read_jsonl(train_log) if r["event"] == "save" and r["iteration"] == ack["iteration"]]
    if not saves:
        raise SystemExit(f"the ack names iteration {ack['iteration']}, but train.py logged no save of it")
    return (f"request {found.group(1)}: iteration {ack['iteration']} saved in {ack['seconds']:.2f} s "
            f"(train.py's reason: {saves[-1]['reason']}), request to ack {seconds:.1f} s"), seconds


def running_job(step: Step) -> None:
    """Items 3 and 4: the GPT example under eft-run --standalone with the sampler on (NVML; in a dry
    run the fake NVML's trace, replayed), then eft top --once and eft ckpt save against its embedded
    etcd, then eft ckpt stop, which every rank answers by saving and exiting 0."""
    out = step.work / "running"
    out.mkdir()
    trace = step.work / "nvml-trace.csv"
    health = "nvml" if step.device == "cuda" else f"replay:{trace}" if trace.exists() else "none"
    log, train_log = out / "agent.log", out / "train.jsonl"
    job = Launched(gpt_command(step, out, 100_000, "--eft-health-source", health, "--eft-health-interval", "1"), log)
    try:
        endpoint, run_id = wait_for(lambda: _alive(job, "the embedded etcd") or _endpoint(log), 120,
                                    "the embedded etcd's endpoint in the log", interval=0.5)
        target = ["--endpoint", endpoint, "--run-id", run_id]
        wait_for(lambda: _alive(job, "training") or any(r["event"] == "iteration" for r in read_jsonl(train_log)),
                 240, "the first iteration", interval=0.5)
        figures, seconds = _top(step, target, job)
        step.row(f"3 eft top --once on a running job (health source {health.split(':')[0]})", "ok", figures,
                 round(seconds, 1))
        figures, seconds = _save(step, target, job, train_log)
        stop = step.eft("ckpt", "stop", *target)
        code = job.wait(180) if stop.returncode == 0 else None
        if code != 0:
            raise SystemExit(f"after eft ckpt stop (exit {stop.returncode}) the job exited {code}")
        last = [r for r in read_jsonl(train_log) if r["event"] == "save"][-1]
        step.row("4 eft ckpt save on a running job", "ok",
                 f"{figures}; then eft ckpt stop: saved iteration {last['iteration']} ({last['reason']}), exit 0",
                 round(seconds, 1))
    finally:
        job.stop()
        print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text(errors='replace').splitlines()[-40:]))


def megatron_lm(step: Step, distributed_optimizer: bool) -> None:
    """Item 5: Megatron-LM's own loop (tests/megatron_lm/pretrain_gpt.py, unmodified megatron.training)
    under eft-run --standalone, a snapshot of its state every iteration, its worker SIGKILLed after
    iteration KILL_AT and resumed from memory; with --use-distributed-optimizer the optimizer's state is
    sharded by Megatron's distributed optimizer (one rank here: the path, not the sharding)."""
    name = "Megatron-LM" + (" --use-distributed-optimizer" if distributed_optimizer else "")
    if importlib.util.find_spec("megatron.training") is None:
        import megatron.core

        step.row(f"5 {name}, worker SIGKILLed", "skipped (no megatron.training)",
                 f"this Python has megatron-core {megatron.core.__version__}; Megatron-LM's loop ships in 0.19+, "
                 f"for Python >= 3.12")
        return
    from megatron_lm import ENV, MODEL, SCRIPT, model_args

    out = step.work / ("mlm-distopt" if distributed_optimizer else "mlm")
    out.mkdir()
    events, log, ckpt = out / "events.jsonl", out / "agent.log", out / "ckpt"
    model = model_args("cuda", 1024, 4, 1024) if step.device == "cuda" else MODEL
    cmd = [*eft_run(), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--eft-health-source", "none",
           "--eft-mem-ckpt-interval", "1", "--eft-events-file", str(events), "--eft-inject", f"rank_killed:0@{KILL_AT}",
           str(SCRIPT), *model, "--train-iters", str(ITERS), "--save", str(ckpt), "--load", str(ckpt),
           "--save-interval", "1000", *(["--use-distributed-optimizer"] if distributed_optimizer else [])]
    started = time.monotonic()
    code = run_job(cmd, log, 300, env=ENV)
    seconds = time.monotonic() - started
    if code != 0:
        raise SystemExit(f"eft-run exited {code}")
    step.row(f"5 {name}, worker SIGKILLed", "ok", report_figures(step, out.name, events, log), round(seconds, 1))


# Opt-in benches (GPU_CHECK_STEPS names them): what the one-off GPU scripts this check replaced
# measured beyond it, at the sizes they ran; each prints its own table, kept under the check's.
BENCHES = {
    "cold-start": ("where a cold worker start goes (bench/cold_start.py)",
                   ["bench/cold_start.py", "--hidden-size", "1024", "--num-layers", "12", "--repeat", "2"]),
    "mlm-overhead": ("Megatron-LM per iteration: torchrun vs eft's hook, numbers check, memory tier "
                     "(bench/megatron_lm.py)",
                     ["bench/megatron_lm.py", "--hidden-size", "1024", "--num-layers", "12", "--seq-length", "1024",
                      "--iters", "40", "--warmup", "10", "--repeat", "1", "--save-every", "20"]),
}


def bench(step: Step, name: str) -> None:
    title, argv = BENCHES[name]
    started = time.monotonic()
    done = subprocess.run([sys.executable, *argv, "--device", step.device], capture_output=True, text=True,
                          cwd=ROOT, timeout=900)
    print(done.stdout, done.stderr[-4000:], sep="\n", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} exited {done.returncode}")
    lines = [line for line in done.stdout.splitlines() if "warn" not in line.lower()]
    step.detail(name, title, "\n".join(lines[-30:]))
    step.row(f"+ {title}", "ok", f"its table: under Details, {name}", round(time.monotonic() - started, 1))

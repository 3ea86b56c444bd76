"""The steps of bench/gpu_check.sh: each runs real eft (eft-run, eft report, eft top, eft ckpt,
the sampler, the memory tier) and appends its rows to a JSON-lines file for the table.

    python bench/gpu_check_steps.py STEP --device cuda|cpu --work DIR --rows FILE [--details DIR]

A step exits non-zero when what it checks did not happen; the shell records that as FAILED.
``--device cpu`` is the dry run: the GPT example's CPU emulation (examples/gpt3/cpu_mode.py),
NVML faked at the pynvml call level (bench/fake_pynvml.py).
Steps: gpt-cold, gpt-warm, mem-ckpt, nvml-risk, running-job, mlm, mlm-distopt; opt-in: cold-start,
mlm-overhead (bench/gpu_check_running.py's BENCHES).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT  # noqa: E402  (also puts the repo on sys.path)
from launch import Launched, eft_run  # noqa: E402

from elasticft.contract.phases import ORDER  # noqa: E402

GPT = ROOT / "examples" / "gpt3" / "train.py"
# The GPT example's tiny CPU model (examples/gpt3/demo.py's), and a small one for one GPU: big
# enough that a restart builds real CUDA and NCCL state, small enough that its memory snapshots
# (bf16 weights, fp32 main copy and Adam moments, ~0.8 GB) fit a VM's /dev/shm or /tmp.
GPT_MODEL = {
    "cpu": ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--global-batch-size", "8",
            "--micro-batch-size", "1", "--lr", "5e-3", "--seed", "1234"],
    "cuda": ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--vocab-size", "8192", "--global-batch-size", "8",
             "--micro-batch-size", "4", "--lr", "1e-4", "--seed", "1234"],
}
KILL_AT, ITERS = 8, 14  # the worker's SIGKILL (--eft-inject rank_killed:0@8) and the run's length
RESUMED = re.compile(r"workers resumed from iteration (\w+) \((\w+)\)(?:; (\d+) iteration\(s\) re-done)?")
EMBEDDED = re.compile(r"embedded etcd on (\S+) \(run id ([\w-]+)\)")


class Step:
    """What every step shares: where it works, how it runs eft's commands, where its rows go."""

    def __init__(self, args: argparse.Namespace):
        self.device, self.work, self.rows, self.details = args.device, args.work, args.rows, args.details
        self.work.mkdir(parents=True, exist_ok=True)
        self.details.mkdir(parents=True, exist_ok=True)

    def row(self, step: str, result: str, figures: str, seconds: float | str = "") -> None:
        with open(self.rows, "a") as f:
            f.write(json.dumps({"step": step, "result": result, "figures": figures, "seconds": seconds}) + "\n")
        print(f"ROW {step}: {result}: {figures}", flush=True)

    def detail(self, name: str, title: str, text: str) -> None:
        """A block printed under the table (eft report's phases, eft top's frame)."""
        (self.details / f"{name}.md").write_text(f"### {title}\n\n```\n{text.rstrip()}\n```\n")
        print(text, flush=True)

    def eft(self, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        """The installed `eft` command (the venv's), else the repository's."""
        cmd = [shutil.which("eft")] if shutil.which("eft") else [sys.executable, "-m", "launcher.cli"]
        done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
        print(f"$ eft {' '.join(args)}\n{done.stdout}{done.stderr}", flush=True)
        return done


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def run_job(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> int:
    job = Launched(cmd, log, env=env)
    try:
        return job.wait(timeout)
    finally:
        job.stop()  # a job past its time: the agent and its workers, every process of the node
        print(f"--- {log.name} (last lines)\n{tail(log)}", flush=True)


def report_figures(step: Step, name: str, events: Path, agent_log: Path) -> str:
    """eft report on the run's event log: the restart's downtime and its phases, the load's tier."""
    text = step.eft("report", "--events", str(events))
    step.detail(name, f"eft report: {name}", text.stdout or text.stderr)
    done = step.eft("report", "--events", str(events), "--json")
    if done.returncode != 0:
        raise SystemExit(f"eft report --json exited {done.returncode}")
    report = json.loads(done.stdout)
    if len(report["failures"]) != 1:
        raise SystemExit(f"expected one failure in the event log, found {len(report['failures'])}")
    failure = report["failures"][0]
    spans: dict[str, float] = {}
    for span in failure["phases"]:
        spans[span["phase"]] = spans.get(span["phase"], 0.0) + span["seconds"]
    phases = ", ".join(f"{p} {spans[str(p)]:.2f}" for p in ORDER if str(p) in spans)
    resumed = RESUMED.findall(agent_log.read_text(errors="replace"))
    if not resumed or resumed[-1][1] != "memory":  # every run here snapshots each iteration
        raise SystemExit(f"the workers did not resume from the memory tier: {resumed}")
    where = f"; resumed from iteration {resumed[-1][0]} ({resumed[-1][1]})"
    return (f"downtime {failure['downtime_seconds']:.2f} s (detection {failure['detection_seconds']:.2f} s); "
            f"phases: {phases}; loaded from {failure['loaded_from']}{where}; "
            f"{report['iterations_redone']} iteration(s) re-done")


def gpt_command(step: Step, out: Path, iters: int, *flags: str) -> list[str]:
    ckpt = out / "ckpt"
    return [*eft_run(), "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", *flags, str(GPT),
            *GPT_MODEL[step.device], "--train-iters", str(iters), "--save", str(ckpt), "--load", str(ckpt),
            "--save-interval", "1000", "--log-file", str(out / "train.jsonl")]


def gpt_restart(step: Step, warm: bool) -> None:
    """Item 1: the GPT example under eft-run --standalone, its one worker SIGKILLed after iteration
    KILL_AT, resumed from the memory tier; cold, or in a warm interpreter."""
    name = "gpt-warm" if warm else "gpt-cold"
    out = step.work / name
    out.mkdir()
    events, log = out / "events.jsonl", out / "agent.log"
    flags = ["--eft-events-file", str(events), "--eft-health-source", "none", "--eft-mem-ckpt-interval", "1",
             "--eft-inject", f"rank_killed:0@{KILL_AT}"]
    if warm:  # the example's own preload module: megatron-core imported after cpu_mode where there is no GPU
        flags += ["--eft-warm-workers", "--eft-preload", "auto,gpt_preload"]
    started = time.monotonic()
    code = run_job(gpt_command(step, out, ITERS, *flags), log, 240)
    seconds = time.monotonic() - started
    if code != 0:
        raise SystemExit(f"eft-run exited {code}")
    figures = report_figures(step, name, events, log)
    starts = re.findall(r"local rank \d+: (warm|cold) start", log.read_text(errors="replace"))
    if warm:
        if "warm" not in starts:
            raise SystemExit(f"no warm start in the agent's log (starts: {starts})")
        figures += f"; restart: {starts[-1]} start"
    step.row(f"1 GPT, worker SIGKILLed, {'warm (--eft-warm-workers)' if warm else 'cold'} restart", "ok",
             figures, round(seconds, 1))


def mem_ckpt(step: Step) -> None:
    """Item 2: bench/mem_ckpt.py, the overlapped device-to-host copy against the blocking one and a
    synchronous torch_dist save of the same state."""
    sizes, repeat = ("500,2000", "2") if step.device == "cuda" else ("50", "1")
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "mem_ckpt.py"), "--device", step.device,
                           "--sizes", sizes, "--repeat", repeat, "--step-seconds", "0.5"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    print(done.stdout, done.stderr[-4000:], sep="\n", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"bench/mem_ckpt.py exited {done.returncode}")
    found = re.findall(r"goal ([\d.]+) MB: stall .*?\(copy overlapped: stall ([\d.]+) s = ([\d.]+) % of ([\d.]+) s; "
                       r"blocking copy: ([\d.]+) s", done.stdout)
    if not found:
        raise SystemExit("no stall figures in bench/mem_ckpt.py's output")
    figures = "; ".join(f"{mb} MB: stall overlapped {over} s ({pct} % of the save), blocking {blocking} s, "
                        f"torch_dist save {disk} s" for mb, over, pct, disk, blocking in found)
    step.row(f"2 memory snapshot stall, state on {step.device}", "ok", figures,
             round(time.monotonic() - started, 1))


def nvml_risk(step: Step) -> None:
    """Item 3: NvmlSource's readings (the GPU's, or the fake NVML's in a dry run) through the risk
    model; the samples also become a trace the dry run's agent replays (eft top then has rows)."""
    from elasticft.health.nvml import NvmlSource
    from elasticft.health.risk import RiskModel
    from elasticft.health.trace import write_trace

    started = time.monotonic()
    load = None
    if step.device == "cuda":
        source = NvmlSource("gpu-check")
        # A GPU busy with matmuls, so that power, clocks and utilisation are a training's, not idle.
        load = subprocess.Popen([sys.executable, "-c", "import torch, time\nx = torch.randn(8192, 8192, "
                                 "device='cuda', dtype=torch.bfloat16)\nend = time.time() + 15\n"
                                 "while time.time() < end:\n    y = x @ x\n    torch.cuda.synchronize()"])
        time.sleep(4)  # the context made, the load running
    else:
        from fake_pynvml import FakeNvml

        clock = iter(range(1_000_000))  # one round a second in the trace
        source = NvmlSource("gpu-check", nvml=FakeNvml(count=2), clock=lambda: time.time() + next(clock))
    model, samples, scores = RiskModel(), [], []
    try:
        for _ in range(10 if step.device == "cuda" else 120):
            round_ = source.read()
            samples += round_
            scores = model.update(round_)
            if step.device == "cuda":
                time.sleep(1)
    finally:
        source.close()
        if load is not None:
            load.wait(30)
    if not scores:
        raise SystemExit("NVML gave no samples")
    write_trace(step.work / "nvml-trace.csv", samples)
    last = {s.gpu: s for s in samples}
    parts = []
    for score in scores:
        s = last[score.gpu]
        missing = [k for k, v in s.to_dict().items() if v is None]
        parts.append(f"GPU {s.gpu}: {s.temperature_c}°C, {s.power_w} W of {s.power_limit_w}, util "
                     f"{s.utilization_pct} %, SM {s.sm_clock_mhz} MHz, risk {score.score:.2f} (dominant "
                     f"{score.dominant or '-'}), fields NVML did not give: {', '.join(missing) or 'none'}")
    print("\n".join(json.dumps(s.to_dict()) for s in samples[-len(scores):]), flush=True)
    step.row("3 NVML sampler -> risk score" + (" (fake NVML)" if step.device == "cpu" else ""), "ok",
             f"{len(samples)} samples; " + "; ".join(parts), round(time.monotonic() - started, 1))


if __name__ == "__main__":
    from gpu_check_running import BENCHES, bench, megatron_lm, running_job

    STEPS = {"gpt-cold": lambda s: gpt_restart(s, False), "gpt-warm": lambda s: gpt_restart(s, True),
             "mem-ckpt": mem_ckpt, "nvml-risk": nvml_risk, "running-job": running_job,
             "mlm": lambda s: megatron_lm(s, False), "mlm-distopt": lambda s: megatron_lm(s, True),
             **{name: (lambda s, name=name: bench(s, name)) for name in BENCHES}}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--work", type=Path, required=True, help="where the step's runs go")
    parser.add_argument("--rows", type=Path, required=True, help="JSON-lines file the step appends its rows to")
    parser.add_argument("--details", type=Path, required=True, help="folder of blocks printed under the table")
    # `timeout` sends SIGTERM: leave through finally, which stops the job's whole tree.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parser.parse_args()
    STEPS[args.step](Step(args))

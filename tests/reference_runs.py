"""Losses of uninterrupted runs that several test modules compare against, made once per test
session: the first module (on whichever pytest-xdist worker) to ask runs it, under a file lock
in the session's shared temporary directory, and the others read its losses. Each run is four
ranks importing megatron-core and training on a 2-core machine: a minute of CI a copy.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.launch import ROOT, read_jsonl
from tests.test_demo import EXAMPLE, ITERS, load

# The memory-tier tests' first layout: TP2 x PP2 on four ranks, one micro batch of 8 (DP1).
# Megatron seeds each pipeline stage's initial weights by its stage, so a run that starts at
# PP2 is a curve of its own. As long as the demo's runs (the learning rate decays over
# --train-iters); a shorter run that decays over LR_DECAY_ITERS has this run's first losses.
TP2_PP2_ITERS = ITERS
LR_DECAY_ITERS = ["--lr-decay-iters", str(TP2_PP2_ITERS)]


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's temporary directory that every xdist worker sees (a worker's own is below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def tp2_pp2_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Iteration -> loss of the GPT example at TP2 x PP2, micro batch 8, TP2_PP2_ITERS iterations."""
    shared = _shared_dir(tmp_path_factory)
    out, done = shared / "reference-tp2-pp2", shared / "reference-tp2-pp2.json"
    with open(shared / "reference-tp2-pp2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or its process dies)
        if not done.exists():
            out.mkdir(exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                   str(EXAMPLE / "train.py"), *load("demo").MODEL, "--train-iters", str(TP2_PP2_ITERS),
                   *LR_DECAY_ITERS, "--micro-batch-size", "8", "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2", "--log-file", str(out / "train.jsonl")]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
            assert run.returncode == 0, run.stderr[-3000:]
            losses = {r["iteration"]: r["loss"] for r in read_jsonl(out / "train.jsonl") if r["event"] == "iteration"}
            done.with_suffix(".tmp").write_text(json.dumps(losses))
            done.with_suffix(".tmp").rename(done)  # whole or absent: a killed run leaves no half file
    return {int(iteration): loss for iteration, loss in json.loads(done.read_text()).items()}

"""How the Bridge lane's tests start the recipe script (pretrain_bridge.py), and plain torchrun's run
of it that eft's runs must reproduce.

Every run is at TP2 (``LAYOUT``): two workers make one tensor-parallel group; four (two nodes)
add data parallelism, which changes no number, so a two-node run that loses a node is compared
with plain torchrun's two workers.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench.launch import Launched
from bench.megatron_lm import ENV
from tests.megatron_lm.test_megatron_lm_e2e import ITERATION, grad_norms, kill_leftovers

SCRIPT = Path(__file__).with_name("pretrain_bridge.py")
LAYOUT = ["model.tensor_model_parallel_size=2"]
EFT_RUN = [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", "--eft-health-source", "none"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ITERS, PLAIN_SAVES = 8, (3, 6, 8)  # plain torchrun's run: saved every 3 iterations, and at its end
LOSS = re.compile(r"\| lm loss: ([0-9.E+-]+) \|")


def start(tmp_path: Path, launcher: list, *overrides, name: str, env: dict | None = None,
          layout: list[str] = LAYOUT) -> Launched:
    """The recipe script under ``launcher`` with Hydra-style overrides (after ``layout``); every
    process of the job carries ``tmp_path`` in EFT_TEST_JOB."""
    return Launched([*map(str, launcher), str(SCRIPT), *layout, *map(str, overrides)], tmp_path / f"{name}.log",
                    env={**ENV, "EFT_TEST_JOB": str(tmp_path), **(env or {})})


def newest(job: Launched) -> int:
    return max(grad_norms(job.output()), default=0)


def losses(log: str) -> list[tuple[int, float]]:
    """(iteration, lm loss) of every iteration Bridge logged, in order (a re-done one again)."""
    found = []
    for line in ITERATION.finditer(log):
        loss = LOSS.search(line.group(0))
        if loss:
            found.append((int(line.group(1)), float(loss.group(1))))
    return found


def run_plain(tmp_path: Path) -> tuple[str, Path]:
    """The script under plain torchrun, ITERS iterations saved every 3: (its log, its checkpoints)."""
    ckpt = tmp_path / "ckpt"
    job = start(tmp_path, TORCHRUN, f"checkpoint.save={ckpt}", f"train.train_iters={ITERS}",
                "checkpoint.save_interval=3", name="torchrun")
    assert job.wait(240) == 0, job.output()[-3000:]
    kill_leftovers(tmp_path)  # torchrun leaves the save's spawn helpers behind: not on this machine
    return job.output(), ckpt

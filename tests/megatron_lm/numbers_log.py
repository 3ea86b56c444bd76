"""The tests' window on a run's numbers: each iteration's gradient norm and loss, unrounded.

Megatron's log line rounds the gradient norm to three decimals; the tests compare runs to
1e-4. With ``EFT_TEST_NUMBERS`` set to a file, ``enable()`` wraps Megatron's
``training_log`` (which every rank calls once per iteration with the step's numbers) so
that the last rank (the last pipeline stage, where the loss is) appends one JSON line per
iteration, with the time it was logged (the benches time restarts by it). Observation only:
the numbers pass through unchanged, and under eft-run or torchrun alike.

With ``EFT_TEST_SNAPSHOTS`` set to a file, each node's local rank 0 also appends one line per
memory snapshot it reports finished to its agent (the outbox's ``mem_saved`` message), so a
test can tell which snapshots a node had written when it was lost.
"""

from __future__ import annotations

import json
import os
import time


def enable() -> None:
    record_snapshots(os.environ.get("EFT_TEST_SNAPSHOTS"))
    path = os.environ.get("EFT_TEST_NUMBERS")
    if not path:
        return
    import torch.distributed as dist
    from megatron.training import training

    original = training.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
        if dist.get_rank() == dist.get_world_size() - 1:
            loss = loss_dict.get("lm loss") if loss_dict else None
            if loss is not None and hasattr(loss, "numel") and loss.numel() == 2:  # (sum, tokens)
                loss = float(loss[0] / loss[1])
            with open(path, "a") as out:
                out.write(json.dumps({"iteration": iteration, "grad_norm": grad_norm, "time": time.time(),
                                      "loss": float(loss) if loss is not None else None}) + "\n")
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                        skipped_iter, grad_norm, *args, **kwargs)

    training.training_log = training_log


def record_snapshots(path: str | None) -> None:
    if not path:
        return
    from elasticft.contract.run_dir import OutboxKind
    from elasticft.worker.relay import Outbox

    original = Outbox.send

    def send(self, message: dict):
        if message.get("type") == OutboxKind.MEM_SAVED:
            with open(path, "a") as out:
                out.write(json.dumps({"node": os.environ.get("GROUP_RANK"), "iteration": message["iteration"],
                                      "pid": os.getpid(),  # a new generation's workers are new processes
                                      "time": time.time()}) + "\n")
        return original(self, message)

    Outbox.send = send


def snapshots(path) -> list[dict]:
    """Every snapshot recorded, in the order the nodes finished them."""
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def first_redone(path) -> dict | None:
    """The first iteration logged again (a restarted generation's first step), or None."""
    reached = 0
    with open(path) as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                if record["iteration"] <= reached:
                    return record
                reached = record["iteration"]
    return None


def read(path) -> dict[int, dict]:
    """Iteration -> its numbers; a later line (a re-done iteration) wins."""
    numbers = {}
    with open(path) as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                numbers[record["iteration"]] = record
    return numbers

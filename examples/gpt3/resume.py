"""The GPT example's start: the newest state the job has, from memory or disk, or none."""

from __future__ import annotations

import time

from run_log import layout_text

from elasticft.worker import CheckpointDir


def resume(trainer, memory, args, log, layout, keep: int) -> tuple[int, str]:
    """The iteration to go on from and where its state came from (memory, disk or none)."""
    started = time.time()
    disk = CheckpointDir(args.load, keep=keep) if args.load else None
    restored = memory.restore(trainer.load, disk)
    if restored.iteration is None:
        if disk is not None and disk.complete_iterations():
            # Starting over would overwrite the run's history; a person must look.
            raise SystemExit(f"none of the complete checkpoints in {args.load} loads (see the warnings)")
        log.say("no checkpoint to load: starting from iteration 0")
        return 0, "none"
    seconds = time.time() - started
    log.record(event="load", iteration=restored.iteration, seconds=seconds, path=restored.path,
               source=restored.source, saved_layout=restored.result, **layout)
    log.say(f"loaded iteration {restored.iteration} from {restored.source} ({restored.path}) in {seconds:.2f} s "
            f"(saved at {layout_text(restored.result)}, now {layout_text(layout)})")
    return restored.iteration, restored.source

"""A rank stuck where a dead peer leaves it (tests/test_stop.py, bench/stop_phase.py --case stuck).

Usage: stuck_peer.py OUT

The first generation (no OUT/killed.json yet): every rank trains 3 steps (a gloo all_reduce and
eft's hook, which installs the handler that only records SIGTERM: a signal-driven save), writes
OUT/first-<RANK>.json (its pid) and meets the others at a barrier. Then the last global rank writes OUT/killed.json (the time)
and SIGKILLs itself; every other rank, like one blocked in an NCCL collective with it, records
the SIGTERM it gets and never returns, whatever the signal but SIGKILL. Then each rank writes
OUT/second-<RANK>.json (when it started, and the first generation's pids still running then: a
zombie holds nothing), trains 3 steps and exits 0: the second generation.
"""

import time

started = time.time()  # before the imports below (torch's take seconds)

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elasticft.worker import Hook  # noqa: E402

out = Path(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# (not TORCHELASTIC_RESTART_COUNT: a node restarted for a peer's failure is not charged, its count stays)
first_generation = not (out / "killed.json").exists()


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if not first_generation:
    first = [json.loads(path.read_text())["worker"] for path in out.glob("first-*.json")]
    (out / f"second-{rank}.json").write_text(json.dumps({"started": started,
                                                         "running": [pid for pid in first if running(pid)]}))

dist.init_process_group("gloo")
hook = Hook()
value = torch.ones(1)
for iteration in range(1, 4):
    dist.all_reduce(value)
    hook.step(iteration)
if first_generation:
    (out / f"first-{rank}.json").write_text(json.dumps({"worker": os.getpid()}))
    dist.barrier()  # every rank's pid is on record, every rank past its collectives
    if rank == world - 1:
        (out / "killed.json").write_text(json.dumps({"time": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # stuck: the hook's handler records SIGTERM, and nothing here looks
        time.sleep(60)
hook.close()
dist.destroy_process_group()

"""A worker for the restart's stop (tests/test_stop.py): its first generation leaves helpers
behind and dies, its second says whether anything of the first still ran when it started.

Usage: stop_probe.py OUT [--ignore-sigterm] [--stopped-helper]

Attempt 0: each local rank starts a helper that ignores SIGTERM (a plain child: same session
and process group, no death signal; with --stopped-helper it is SIGSTOPped too), writes
OUT/first-<rank>.json (its pid, its helper's) and trains (a gloo all_reduce and eft's hook per
step). After step 3 local rank 1 SIGKILLs itself; its peer's next all_reduce fails, or, with
--ignore-sigterm, rank 0 stops training, ignores SIGTERM and sleeps: a rank stuck where no
signal but SIGKILL ends it. Attempt 1 writes OUT/seen-<rank>.json, the first generation's
pids still running when it started (a zombie holds nothing: not running), trains 3 steps and
exits 0.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from elasticft.worker import Hook

out = Path(sys.argv[1])
rank, ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
first_generation = not int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if not first_generation:
    first = [pid for r in range(ranks) for pid in json.loads((out / f"first-{r}.json").read_text()).values()]
    (out / f"seen-{rank}.json").write_text(json.dumps({"running": [pid for pid in first if running(pid)]}))
else:
    if rank == 0 and "--ignore-sigterm" in sys.argv:  # before rank 1 can die: the stop's SIGTERM finds it in place
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    helper = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    helper.stdout.readline()  # its SIGTERM handler is in place
    if "--stopped-helper" in sys.argv:
        os.kill(helper.pid, signal.SIGSTOP)
    (out / f"first-{rank}.json").write_text(json.dumps({"worker": os.getpid(), "helper": helper.pid}))

dist.init_process_group("gloo")
hook = Hook()
value = torch.ones(1)
for iteration in range(1, 4 if not first_generation else 1000):
    dist.all_reduce(value)
    hook.step(iteration)
    if first_generation and iteration == 3:
        dist.barrier()  # every rank's pids are on record
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0 and "--ignore-sigterm" in sys.argv:
            time.sleep(600)
hook.close()
dist.destroy_process_group()

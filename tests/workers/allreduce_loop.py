"""A test worker: joins the gloo group, records who it is, all-reduces until told to stop.

Usage: allreduce_loop.py OUT_DIR [ARGS...]
  Appends one JSON line per start to OUT_DIR/starts.jsonl (rank, world size, restart
  count, the all_reduce result, when the process started and when it joined, the
  ARGS it was given and the EFT_TP/PP/DP it saw). Stops, on every rank at the same iteration, once
  OUT_DIR/finish exists (the flag is all-reduced, so all ranks agree).
"""

import time

STARTED = time.time()  # before torch is imported: when the launcher started us

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
record = {
    "pid": os.getpid(),
    "rank": rank,
    "world_size": world,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "sum": total.item(),
    "started": STARTED,
    "args": sys.argv[2:],
    "layout": [os.environ.get(k) for k in ("EFT_TP", "EFT_PP", "EFT_DP")],
    "time": time.time(),
}
with open(os.path.join(out, "starts.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\n")

finish = os.path.join(out, "finish")
while True:
    flag = torch.tensor([1.0 if os.path.exists(finish) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        break
    time.sleep(0.05)
dist.destroy_process_group()

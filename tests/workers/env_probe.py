"""A test worker: all-reduces once and dumps its torchrun environment as JSON.

Usage: env_probe.py OUT_DIR -> OUT_DIR/env-<RANK>.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(value)
env = dict(os.environ)
env["ALL_REDUCE_SUM"] = str(value.item())
with open(os.path.join(sys.argv[1], f"env-{os.environ['RANK']}.json"), "w") as f:
    json.dump(env, f)
dist.destroy_process_group()

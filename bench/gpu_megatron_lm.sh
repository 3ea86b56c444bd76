#!/usr/bin/env bash
# What was run on a lent GPU for issue 32, in one command: Megatron-LM's own loop
# (tests/megatron_lm/pretrain_gpt.py, megatron.training unmodified) on one GPU, bf16, nccl:
#   the NVML sampler on the real GPU, then bench/megatron_lm.py: torchrun against eft's hook,
#   numbers check and memory tier (a snapshot of Megatron's own state every iteration, copied off
#   the GPU), beside Megatron's torch_dist save of the same state, and a checkpoint request
#   answered through Megatron's own save.
# The lent machine's torch (2.11) is older than eft's agent supports (2.13: the torch seam
# refuses it at import, and says so below), so the bench runs eft's worker side alone under
# torchrun (--agent none: the run directory and variables eft-run gives its workers); the agent's
# paths (a hang's restart) are the CPU lane's. megatron-core, etcd-sdk-python, py-spy and the etcd
# binary travel in .whl/ (carry it). The wheel ships megatron-core's compiled dataset helper but no
# Makefile, so plain torchrun's rank 0 fails in `make` (eft-run skips it; see docs/megatron-lm.md):
# a no-op Makefile stands in for the baseline. Output goes to $OUT (the device tool) or ./gpu-out.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.whl:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
printf 'all:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
SIZE=${SIZE:---hidden-size 1024 --num-layers 12 --seq-length 1024}
# Host memory for the memory tier: /dev/shm where it can hold a few snapshots (a VM's may be small).
if [ "$(df --output=avail -k /dev/shm | tail -1)" -lt 33554432 ]; then export EFT_MEM_CKPT_DIR=/tmp; fi
{
  nvidia-smi -L
  python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
  df -h /dev/shm | tail -1
  python3 -c "import elasticft.torch_seam" 2>&1 | tail -1
  echo "== NVML sampler =="
  timeout 60 python3 -c "
from elasticft.health.nvml import NvmlSource
source = NvmlSource('gpu-node')
for sample in source.read():
    print(sample)
source.close()"
} 2>&1 | tee "$OUT/gpu.txt"
echo "== per-iteration cost: torchrun vs eft ($SIZE) ==" | tee "$OUT/bench.txt"
timeout "${BENCH_TIMEOUT:-300}" python3 bench/megatron_lm.py --device cuda --agent none $SIZE --iters "${ITERS:-40}" \
  --warmup 10 --repeat 1 --save-every 20 2>&1 | grep -v -i warn | tail -40 | tee -a "$OUT/bench.txt"

#!/usr/bin/env bash
# What was run on a lent GPU machine for issue 14 (the memory tier), in one command:
#   the NVML sampler on the real GPU, bench/mem_ckpt.py with the state on the GPU (the
#   snapshot's stall is then the device-to-host copy into pinned buffers), and the GPT example
#   (bf16, nccl) with the worker's memory tier on, its agent's part emulated by the run
#   directory variables (eft-run's agent needs torch 2.13; that machine has another torch).
# Wheels that the machine lacks travel in .whl/ (megatron-core for its Python, etcd-sdk-python).
# Output goes to $OUT (the device tool) or ./gpu-out.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" | tee -a "$OUT/gpu.txt"

echo "== NVML sampler ==" | tee "$OUT/nvml.txt"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/nvml.txt"
from elasticft.health.nvml import NvmlSource
source = NvmlSource("gpu-node")
for sample in source.read():
    print(sample)
source.close()
EOF

echo "== bench/mem_ckpt.py, state on the GPU ==" | tee "$OUT/bench.txt"
python3 bench/mem_ckpt.py --device cuda --sizes "${SIZES:-500,2000}" --repeat 3 2>&1 | grep -v -i warn | tee -a "$OUT/bench.txt"

echo "== GPT example, bf16 on the GPU, memory checkpoint every iteration ==" | tee "$OUT/gpt.txt"
run=$(mktemp -d)
mem="$run/mem"  # host memory when /dev/shm can hold the state (a container's may be 64 MB)
if [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 33554432 ]; then mem=/dev/shm/eft-gpt; fi
df -h /dev/shm "$run" | tee -a "$OUT/gpt.txt"
mkdir -p "$run/run" "$mem"
EFT_RUN_DIR="$run/run" EFT_MEM_CKPT_WRITE_DIR="$mem" EFT_MEM_CKPT_INTERVAL=1 EFT_EXIT_SIGNALS="" \
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 examples/gpt3/train.py \
  --num-layers 12 --hidden-size 1536 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 \
  --vocab-size 32000 --global-batch-size 8 --micro-batch-size 4 --train-iters 24 --lr 1e-4 --seed 1234 \
  --save "$run/ckpt" --save-interval 12 --log-file "$OUT/gpt.jsonl" 2>&1 | grep -v -i warn | tail -40 | tee -a "$OUT/gpt.txt"
python3 - "$OUT/gpt.jsonl" <<'EOF' 2>&1 | tee -a "$OUT/gpt.txt"
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steps = [r["seconds"] for r in records if r["event"] == "iteration"][3:]
stalls = [r["stall"] for r in records if r["event"] == "mem_saved" and r.get("stall")][1:]
saves = [r["seconds"] for r in records if r["event"] == "save"]
print(f"iterations: median {statistics.median(steps):.3f} s; memory snapshots complete: {len(stalls) + 1}")
if stalls:
    print(f"memory snapshot stall (plan + the update's wait for the device-to-host copy): median {statistics.median(stalls):.3f} s, "
          f"max {max(stalls):.3f} s")
if saves:
    print(f"torch_dist disk save (synchronous): {', '.join(f'{s:.2f}' for s in saves)} s")
EOF
rm -rf "$mem" "$run"

#!/usr/bin/env bash
# Issue 34's groundwork on a lent GPU: where one worker's cold start goes (interpreter, imports,
# CUDA context, NCCL process group, a megatron-core GPT built, the first step), next to a
# warm interpreter that did the imports ahead (and one that also made its CUDA context).
# megatron-core travels in .whl/ (carry it), as for bench/gpu_megatron_lm.sh.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
  for size in "--hidden-size 1024 --num-layers 12" "--hidden-size 4096 --num-layers 8"; do
    timeout 280 python3 bench/cold_start.py --device cuda $size --repeat "${REPEAT:-3}" 2>&1 | grep -v -i warn | tail -12
  done
} 2>&1 | tee "$OUT/cold_start.txt"

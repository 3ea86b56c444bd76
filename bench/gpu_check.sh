#!/usr/bin/env bash
# A whole eft-run on one GPU, prepared to run in one call of the device tool (issue 44, item 5):
#   0. setup: a venv over the machine's Python (--system-site-packages: its torch is used and
#      left as it is, checked with pip list before and after), eft and what it needs from .whl/
#      (bench/gpu_wheels.sh fills it here: the machine has no network), etcd on PATH;
#   1. the GPT example under eft-run --standalone, its worker SIGKILLed mid-run and resumed from
#      the memory tier: a cold restart, then --eft-warm-workers; eft report's restart phases;
#   2. the memory snapshot's stall: the overlapped device-to-host copy against the blocking one
#      and a synchronous torch_dist save (bench/mem_ckpt.py);
#   3. the NVML sampler's readings through the risk score; eft top --once on a running job;
#   4. eft ckpt save on that running job (then eft ckpt stop ends it);
#   5. Megatron-LM's own loop under eft-run, its worker SIGKILLed and resumed from memory; again
#      with --use-distributed-optimizer.
# Each step has its own timeout (and the run a budget, GPU_CHECK_BUDGET seconds); a failed step
# is recorded and the next one runs. Results: $OUT/gpu_check.md (one table, rewritten after
# every step), the raw log $OUT/gpu_check.log, each step's log in $OUT/steps/. $OUT is the device
# tool's; elsewhere ./gpu-out.
#
#   bash bench/gpu_wheels.sh                  # here (network): fills .whl/
#   bash bench/gpu_check.sh                   # on the GPU machine, with carry [".whl"]
#   bash bench/gpu_check.sh --dry             # (or GPU_CHECK_DRY=1) on a CPU machine: the GPT
#       example's CPU emulation and a fake NVML; the steps that need CUDA say "skipped (dry)"
#
# Knobs: GPU_CHECK_PYTHON (the interpreter the venv is made from; python3), GPU_CHECK_BUDGET
# (seconds for all steps; 450 on a GPU, 1800 dry), GPU_CHECK_STEPS (ids to run, comma-separated:
# gpt-cold, gpt-warm, mem-ckpt, nvml-risk, running-job, mlm, mlm-distopt, and the opt-in
# cold-start, mlm-overhead; default: all but the opt-in ones), GPU_CHECK_WORK (the runs' scratch
# folder; a new one under /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY:-0}
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/steps" "$OUT/rows" "$OUT/details" "$OUT/steps.tsv" "$OUT/gpu_check.md"
mkdir -p "$OUT/steps" "$OUT/rows" "$OUT/details"
LOG=$OUT/gpu_check.log
: > "$LOG"
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/eft-gpu-check.XXXXXX)}
mkdir -p "$WORK"
PYTHON=${GPU_CHECK_PYTHON:-python3}
VENV=$WORK/venv
if [ "$DRY" = 1 ]; then DEVICE=cpu; BUDGET=${GPU_CHECK_BUDGET:-1800}; else DEVICE=cuda; BUDGET=${GPU_CHECK_BUDGET:-450}; fi
DEADLINE=$(( $(date +%s) + BUDGET ))
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_CACHE_DIR=1
# The memory tier's snapshots go to host memory: /dev/shm where it can hold them (a VM's or a
# container's may be 64 MB), else /tmp.
if [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -lt 16777216 ] 2>/dev/null; then
  export EFT_MEM_CKPT_DIR=$WORK/mem
fi

say() { echo "gpu_check: $*" | tee -a "$LOG"; }
table() { "$PYTHON" bench/gpu_check_table.py "$OUT" >> "$LOG" 2>&1; }

# step ID TITLE LIMIT_GPU LIMIT_DRY cuda|any COMMAND...: runs COMMAND under `timeout`, its output
# in steps/ID.log and the raw log; one line in steps.tsv; the table rewritten.
step() {
  local id=$1 title=$2 limit=$3 needs=$5 state started seconds rc
  [ "$DRY" = 1 ] && limit=$4
  shift 5
  local listed=0
  [[ ",${GPU_CHECK_STEPS:-}," == *",$id,"* ]] && listed=1
  # setup always runs; an opt-in step only when named; the others unless GPU_CHECK_STEPS leaves them out
  if [ "$id" != setup ] && { [ "$needs" = optin ] || [ -n "${GPU_CHECK_STEPS:-}" ]; } && [ "$listed" = 0 ]; then
    return 0
  fi
  [ "$needs" = optin ] && needs=cuda
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$DRY" = 1 ] && [ "$needs" = cuda ]; then
    state="skipped:dry"
  elif [ "$left" -lt 30 ]; then
    state="skipped:out of time, GPU_CHECK_BUDGET=$BUDGET s"
  fi
  if [ -n "${state:-}" ]; then
    printf '%s\t%s\t%s\t\n' "$id" "$title" "$state" >> "$OUT/steps.tsv"
    say "$id: $state"; table; return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  say "== $id: $title (timeout $limit s)"
  started=$(date +%s%N)
  # a fresh bash for the step: `timeout` runs programs, and the steps are this script's functions
  timeout -k 20 "$limit" bash -c '"$@"' step "$@" > "$OUT/steps/$id.log" 2>&1
  rc=$?
  seconds=$(( ($(date +%s%N) - started) / 1000000 ))
  seconds=$(( seconds / 1000 )).$(( seconds % 1000 / 100 ))
  cat "$OUT/steps/$id.log" >> "$LOG"
  case $rc in
    0) state=ok ;;
    124|137) state="timeout:$limit" ;;
    *) state="failed:$rc" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$id" "$title" "$state" "$seconds" >> "$OUT/steps.tsv"
  say "$id: $state in $seconds s"
  table
}

steps_py() { "$VENV/bin/python" bench/gpu_check_steps.py "$1" --device "$DEVICE" --work "$WORK" \
  --rows "$OUT/rows/$2.jsonl" --details "$OUT/details"; }

setup() {
  local figures torch_before torch_after
  [ -d .whl ] && compgen -G ".whl/elasticft-*.whl" > /dev/null \
    || { echo "gpu_check: no .whl/ (run bash bench/gpu_wheels.sh where there is network, then carry .whl)"; return 1; }
  # A Debian Python without python3-venv has no ensurepip: then a venv without pip, whose
  # interpreter runs the machine's pip (visible through the system site), installing into it.
  "$PYTHON" -m venv --system-site-packages "$VENV" \
    || { rm -rf "$VENV"; "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"; } || return 1
  # torch and CUDA's packages as the machine has them; the install must not change a line of it.
  torch_before=$("$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|triton|nvidia-\S+) ' | grep -iv '^nvidia-ml-py ')
  echo "before: ${torch_before:-no torch}"
  # eft's own wheel without its requirements: its torch range is checked by eft at launch, not by pip
  # here, where no index could bring another torch anyway.
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --force-reinstall .whl/elasticft-*.whl || return 1
  # The rest, each with the specifiers its requirers ask for: what the machine has is kept where it
  # satisfies them, the rest comes from .whl/. --no-deps: the list is already closed under
  # Requires-Dist (bench/gpu_wheels_deps.py), and pip would otherwise re-resolve torch's own
  # requirements against a folder that holds none of them.
  "$VENV/bin/python" bench/gpu_check_install.py .whl > "$WORK/requirements.txt" || return 1
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --find-links .whl -r "$WORK/requirements.txt" || return 1
  "$VENV/bin/python" -m pip check || echo "gpu_check: pip check is not clean (above); going on"
  torch_after=$("$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(torch|triton|nvidia-\S+) ' | grep -iv '^nvidia-ml-py ')
  if [ "$torch_before" != "$torch_after" ]; then
    echo "gpu_check: the install changed torch's packages:"; diff <(echo "$torch_before") <(echo "$torch_after")
    return 1
  fi
  mkdir -p "$WORK/bin"
  if [ -f .whl/etcd.gz ]; then gunzip -c .whl/etcd.gz > "$WORK/bin/etcd" && chmod +x "$WORK/bin/etcd"; fi
  export PATH=$WORK/bin:$VENV/bin:$PATH
  figures=$("$VENV/bin/python" -I - <<'EOF'  # -I: the installed eft, not the one in the working directory
import importlib.metadata as md, platform, shutil, subprocess, torch, elasticft
cuda = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no CUDA"
etcd = subprocess.run([shutil.which("etcd"), "--version"], capture_output=True, text=True).stdout.split("\n")[0]
print(f"Python {platform.python_version()}, torch {torch.__version__} ({cuda}; pip list unchanged), "
      f"megatron-core {md.version('megatron-core')}, eft {md.version('elasticft')} from "
      f"{elasticft.__file__.rsplit('/elasticft/', 1)[0]}, {etcd} at {shutil.which('etcd')}")
EOF
) || return 1
  echo "$figures" | tee "$OUT/rows/setup.txt"
}
export OUT WORK PYTHON VENV DEVICE
export -f setup steps_py

{
  echo "$(date -u +%FT%TZ) on $(hostname); $( [ "$DRY" = 1 ] && echo "dry run (CPU)" || nvidia-smi -L 2>&1 | head -4 | tr '\n' ' ')"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' + local changes'); budget $BUDGET s"
} > "$OUT/header.txt"
cat "$OUT/header.txt" | tee -a "$LOG"

step setup "0 setup: venv, wheels, torch unchanged, etcd" 150 300 any setup
if ! grep -q "^setup	.*	ok	" "$OUT/steps.tsv"; then
  say "setup failed: the steps below need it"; table; exit 1
fi
export PATH=$WORK/bin:$VENV/bin:$PATH
step gpt-cold "1 GPT, worker SIGKILLed, cold restart" 120 420 any steps_py gpt-cold gpt-cold
step gpt-warm "1 GPT, worker SIGKILLed, warm restart" 100 420 any steps_py gpt-warm gpt-warm
step mem-ckpt "2 memory snapshot stall" 120 300 any steps_py mem-ckpt mem-ckpt
step nvml-risk "3 NVML sampler -> risk score" 45 120 any steps_py nvml-risk nvml-risk
step running-job "3+4 eft top --once, eft ckpt save on a running job" 120 420 any steps_py running-job running-job
step mlm "5 Megatron-LM, worker SIGKILLed, resumed from memory" 120 420 any steps_py mlm mlm
step mlm-distopt "5 Megatron-LM --use-distributed-optimizer, worker SIGKILLed" 120 420 cuda steps_py mlm-distopt mlm-distopt
# Opt-in (GPU_CHECK_STEPS=...,cold-start,mlm-overhead and GPU_CHECK_BUDGET about 300 s more each): what the
# one-off GPU scripts this check replaced measured beyond it.
step cold-start "+ where a cold worker start goes" 300 300 optin steps_py cold-start cold-start
step mlm-overhead "+ Megatron-LM per iteration, torchrun vs eft" 400 400 optin steps_py mlm-overhead mlm-overhead
table
say "done: $OUT/gpu_check.md"
cat "$OUT/gpu_check.md"
grep -q "FAILED" "$OUT/gpu_check.md" && exit 1
exit 0

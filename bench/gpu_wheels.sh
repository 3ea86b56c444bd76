#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with what bench/gpu_check.sh installs on a GPU machine that has
# Python 3.12 and torch but no network: eft's wheel, the wheels of its dependencies for CPython
# 3.12 on manylinux x86_64 except torch's own stack (bench/gpu_wheels_deps.py follows each
# Requires-Dist), megatron-core 0.19.2 (Megatron-LM's loop: megatron.training ships in it from
# 0.19 on, for Python >= 3.12), py-spy (hung ranks' stacks), numpy (torch runs without it, eft's
# goodput and megatron-core do not), and the etcd server, gzipped (the embedded etcd of
# --standalone needs the binary; gzip halves what travels). Then prints the folder's size: the
# device tool carries at most 64 MiB of ignored paths, the working tree included.
#
#   bash bench/gpu_wheels.sh            # here, with network
#   then on the device: run with carry [".whl"]: bash bench/gpu_check.sh
#
# ETCD=/path/to/etcd picks the binary (default: the one on PATH; Debian's etcd-server has one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHL=.whl
rm -rf "$WHL"
mkdir -p "$WHL"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

echo "== eft's wheel"
"$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$WHL" .
ls "$WHL"

echo "== dependencies for CPython 3.12, manylinux x86_64 (not torch's stack)"
# pyproject's dependencies, as written, less torch (the machine's stays); then the extras this
# check needs. The versions pip picks are the newest the specifiers allow.
mapfile -t deps < <("$PYTHON" - <<'EOF'
import tomllib
from packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for line in project["dependencies"]:
    if Requirement(line).name != "torch":
        print(line)
EOF
)
"$PYTHON" bench/gpu_wheels_deps.py "$WHL" "${deps[@]}" "megatron-core==0.19.2" py-spy numpy

echo "== etcd server"
etcd_bin=${ETCD:-$(command -v etcd || true)}
if [ -z "$etcd_bin" ]; then
  echo "gpu_wheels: no etcd on PATH: apt-get install etcd-server, or ETCD=/path/to/etcd" >&2
  exit 1
fi
"$etcd_bin" --version | head -1
gzip -9 -c "$etcd_bin" > "$WHL/etcd.gz"

echo "== $WHL"
ls -la "$WHL"
du -sh "$WHL"
size=$(du -sm "$WHL" | cut -f1)
if [ "$size" -gt 60 ]; then
  echo "gpu_wheels: $WHL is $size MiB, over the 60 MiB it must stay under (64 MiB carried in all)" >&2
  exit 1
fi

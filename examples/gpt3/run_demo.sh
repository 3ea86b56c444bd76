#!/usr/bin/env bash
# The eft demo (see examples/gpt3/demo.py): a dying GPU, an emergency checkpoint, a lost
# node, and training that goes on at a new layout. Extra arguments go to demo.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python examples/gpt3/demo.py "$@"

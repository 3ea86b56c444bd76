"""Megatron-Bridge's lane: Bridge's own training loop (megatron.bridge.training), installed as
.ci/setup_bridge installs it (its wheel with --no-deps and what a GPT pretrain imports). CI runs
this directory with that environment; elsewhere (no Bridge installed) it is skipped."""

import importlib.util

try:
    _HAVE_BRIDGE = importlib.util.find_spec("megatron.bridge") is not None
except ImportError:  # no megatron at all
    _HAVE_BRIDGE = False

if not _HAVE_BRIDGE:
    collect_ignore_glob = ["test_*.py"]

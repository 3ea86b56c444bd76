"""The Megatron-LM lane: Megatron-LM's own training loop (megatron.training), which
megatron-core ships from 0.17 on, for Python >= 3.12 (.ci/setup_mlm builds its
environment; .ci/run runs this directory with it). Elsewhere the directory is skipped."""

import importlib.util

try:
    _HAVE_MEGATRON_TRAINING = importlib.util.find_spec("megatron.training") is not None
except ImportError:  # no megatron at all
    _HAVE_MEGATRON_TRAINING = False

if not _HAVE_MEGATRON_TRAINING:
    collect_ignore_glob = ["test_*.py"]

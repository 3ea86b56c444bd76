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
else:
    import pytest

    @pytest.fixture(scope="session")
    def plain(tmp_path_factory):
        """The script under plain torchrun (tests/megatron_bridge/jobs.py): the numbers eft's runs must reproduce."""
        from tests.megatron_bridge.jobs import run_plain

        return run_plain(tmp_path_factory.mktemp("plain"))

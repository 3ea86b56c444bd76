"""The one seam to torch's private API (agent-side accessors; see tests/test_torch_seam.py)."""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID


def worker_process_context(agent) -> Any:
    """torch's process context of the agent's running workers (replaced at every restart), or None."""
    return agent._pcontext


def clear_worker_process_context(agent) -> None:
    """A spare node runs no workers: torch must not monitor the previous round's."""
    agent._pcontext = None


def worker_pids(agent) -> list[int]:
    """The pids of the agent's running workers ([] when none run)."""
    pcontext = agent._pcontext
    return list(pcontext.pids().values()) if pcontext is not None else []


def remaining_restarts(agent) -> int:
    return agent._remaining_restarts


def exit_barrier_reached(agent) -> bool:
    """Whether the working nodes reached torch's exit barrier (a spare node then finishes)."""
    try:
        return bool(agent._store.check([_TERMINAL_STATE_SYNC_ID + "/num_members"]))
    except Exception:  # noqa: BLE001 - a store in trouble is the working nodes' problem
        return False


def forget_bootstrap_store(handler) -> None:
    """Make torch publish this round's master address instead of the first round's."""
    if hasattr(handler, "_bootstrap_store_info"):
        handler._bootstrap_store_info = None

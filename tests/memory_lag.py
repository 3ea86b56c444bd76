"""The memory tier's promise when a node is lost, as the end-to-end tests check it.

The lost node's share comes from its replica: the job resumes from a snapshot the workers
wrote before the loss, at most ``--eft-mem-ckpt-max-lag`` + 1 snapshots behind the newest of
them (past the lag the snapshots back off until replication catches up). Where in that window
depends on how fast replicas travel: 1 or 2 iterations on a quiet machine, 3 when the other
core is busy; either is the product working.
"""

from __future__ import annotations

from elasticft.config import ReplicationConfig


def assert_resumed_within_the_lag(resumed: int, written: list[int], who: str = "") -> None:
    """``written``: the iterations a node's workers finished a snapshot of before the loss."""
    newer = [i for i in written if i > resumed]
    assert resumed in written and len(newer) <= ReplicationConfig().mem_ckpt_max_lag + 1, (who, resumed, written)

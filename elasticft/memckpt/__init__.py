"""The memory checkpoint tier, the node agent's side (``contract.memory`` is what it shares).

Snapshots of the workers' state live in host memory (tmpfs) on the node that wrote them and,
as replicas, on other nodes; etcd holds only an index of them. After a failure the survivors
prepare the newest iterations they can complete and the workers load one instead of the
slower (and older) disk checkpoint. ``MemoryTier`` is the one class the agent uses.
"""

from elasticft.memckpt.tier import MemoryTier

__all__ = ["MemoryTier"]

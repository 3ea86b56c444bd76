"""A restart's control path at the node counts bench/restart_scale.py measured: written by its
--write-curve (2026-11-28), not by hand. ``eft simulate`` charges a restart what this curve says at the
job's size (``restart_curve.py``); detection, the lease's expiry, is its own cost.
"""

from elasticft.goodput.restart_curve import RestartCurve

SOURCE = "bench/restart_scale.py 2026-11-28: one host per node, from per-unit costs measured on a 2-core host (latency, one node's CPU, etcd's CPU)"
NODES = (8, 32, 64, 128, 256)
PHASES = {
    'stop': (0.0145, 0.0358, 0.0849, 0.1852, 0.5912),
    'rendezvous': (0.0317, 0.0912, 0.124, 0.1941, 0.2917),
    'replan': (0.0461, 0.084, 0.1254, 0.1957, 0.3998),
    'spawn': (0.0849, 0.112, 0.1541, 0.2717, 0.5341),
    'imports': (0.0004, 0.0004, 0.0005, 0.0004, 0.0004),
    'process_group': (0.0004, 0.0003, 0.0004, 0.0004, 0.0003),
    'load': (0.0042, 0.0045, 0.0048, 0.005, 0.0051),
    'first_step': (0.0061, 0.006, 0.006, 0.0063, 0.0069),
}


def measured_curve() -> RestartCurve:
    return RestartCurve(NODES, PHASES, SOURCE)

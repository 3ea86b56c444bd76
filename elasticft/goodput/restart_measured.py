"""A restart's control path at the node counts bench/restart_scale.py measured: written by its
--write-curve (2026-11-28), not by hand. ``eft simulate`` charges a restart what this curve says at the
job's size (``restart_curve.py``); detection, the lease's expiry, is its own cost.
"""

from elasticft.goodput.restart_curve import RestartCurve

SOURCE = "bench/restart_scale.py 2026-11-28: one host per node, from per-unit costs measured on a 2-core host (latency, one node's CPU, etcd's CPU)"
NODES = (8, 32, 64, 128, 256)
PHASES = {
    'stop': (0.0185, 0.063, 0.1028, 0.3053, 0.6018),
    'rendezvous': (0.0374, 0.0856, 0.0841, 0.2313, 0.3759),
    'replan': (0.1096, 0.1534, 0.2491, 0.3267, 0.5476),
    'spawn': (0.0496, 0.0824, 0.182, 0.3397, 2.2763),
    'imports': (0.0003, 0.0003, 0.0002, 0.0002, 0.0002),
    'process_group': (0.0004, 0.0003, 0.0003, 0.0003, 0.0003),
    'load': (0.0047, 0.0043, 0.0046, 0.0047, 0.0155),
    'first_step': (0.0022, 0.0021, 0.0023, 0.0025, 0.0133),
}


def measured_curve() -> RestartCurve:
    return RestartCurve(NODES, PHASES, SOURCE)

"""A restart's control path at the node counts bench/restart_scale.py measured: written by its
--write-curve (2026-11-28), not by hand. ``eft simulate`` charges a restart what this curve says at the
job's size (``restart_curve.py``); detection, the lease's expiry, is its own cost.
"""

from elasticft.goodput.restart_curve import RestartCurve

SOURCE = 'bench/restart_scale.py 2026-11-28, 2 cores, vote group lazy, one rank per node'
NODES = (8, 32, 128)
PHASES = {
    'stop': (0.0146, 0.0402, 0.3005),
    'rendezvous': (0.0369, 0.0751, 0.3821),
    'replan': (0.017, 0.3527, 6.6862),
    'spawn': (0.0336, 1.0723, 1.3334),
    'imports': (0.0007, 0.0004, 0.0009),
    'process_group': (0.0015, 0.001, 4.0882),
    'load': (0.0279, 0.0143, 0.0768),
    'first_step': (0.0054, 0.0165, 0.1318),
}


def measured_curve() -> RestartCurve:
    return RestartCurve(NODES, PHASES, SOURCE)

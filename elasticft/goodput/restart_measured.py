"""A restart's control path at the node counts bench/restart_scale.py measured: written by its
--write-curve (2026-11-28), not by hand. ``eft simulate`` charges a restart what this curve says at the
job's size (``restart_curve.py``); detection, the lease's expiry, is its own cost.
"""

from elasticft.goodput.restart_curve import RestartCurve

SOURCE = "bench/restart_scale.py 2026-11-28: all N nodes on one 2-core host, an upper bound of a cluster's"
NODES = (8, 32, 128, 256)
PHASES = {
    'stop': (0.0196, 0.0857, 0.4592, 1.379),
    'rendezvous': (0.0463, 0.141, 0.6325, 0.8371),
    'replan': (0.0491, 0.1951, 0.5227, 1.3293),
    'spawn': (0.056, 0.3198, 3.6043, 13.5953),
    'imports': (0.0006, 0.0004, 0.0012, 0.0037),
    'process_group': (0.0004, 0.0021, 0.0006, 0.0008),
    'load': (0.004, 0.0235, 0.1441, 0.3595),
    'first_step': (0.002, 0.0118, 0.1237, 0.3345),
}


def measured_curve() -> RestartCurve:
    return RestartCurve(NODES, PHASES, SOURCE)

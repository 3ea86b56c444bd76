"""Goodput: how much of a job's paid GPU time advanced training.

``eft report`` measures it for a real run from the event log (breakdown.py); ``eft
simulate`` estimates it for a job of any size under failure models and policies
(simulate.py). Both speak ``JobCosts`` (costs.py): what report measures is what the
simulator replays. Pure: imports only ``elasticft.contract``.
"""

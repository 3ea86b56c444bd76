"""eft inside Megatron-Bridge's own training loop (``megatron.bridge.training``).

``mode`` decides at launch whether a script is a Bridge job; ``attach`` runs in its workers and
enters the loop when the script imports it; ``loop`` is what eft does there; ``recipe`` applies
eft's re-plan and its fault tolerance to the recipe's ConfigContainer. Every Bridge name goes
through ``elasticft.bridge_seam``.
"""

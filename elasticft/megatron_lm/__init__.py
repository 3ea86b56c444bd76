"""eft inside an unmodified Megatron-LM script (``megatron.training.pretrain``'s loop).

The launcher decides whether a job is one (``mode.py``, ``--eft-megatron-lm``) and puts
``elasticft/boot/`` on the workers' ``PYTHONPATH``; its ``sitecustomize`` installs ``attach.py``'s
import finder, which attaches ``loop.py`` to Megatron's loop when the script imports it.
Megatron's internal names are reached only through ``elasticft.megatron_seam``.
docs/megatron-lm.md is the user's side.
"""

"""eft: elastic, fault-tolerant launching for Megatron training."""

__version__ = "0.1.0"

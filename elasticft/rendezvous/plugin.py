"""The ``torchrun.handlers`` entry point for the ``etcd-v3`` rendezvous.

torch imports entry points while its rendezvous package is still initialising, so
this module must not import torch itself: the real work is imported on first use.
"""

from elasticft.contract.keys import BACKEND_NAME


def create_etcd_v3_handler(params):
    """Registry creator: ``RendezvousParameters`` -> ``RendezvousHandler``."""
    from elasticft.rendezvous.backend import create_handler

    return create_handler(params)


def handler_factory():
    """torch calls this and registers what it returns under the entry point's name."""
    return create_etcd_v3_handler


def register() -> None:
    """Register ``etcd-v3`` even where the package metadata is absent (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND_NAME, create_etcd_v3_handler)

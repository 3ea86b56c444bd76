"""Every name of pyetcd (etcd-sdk-python) eft uses beyond its documented client API.

``tests/test_store.py::test_the_pyetcd_names_eft_relies_on_are_there`` fails when an
upgrade moves one of them.
"""

from __future__ import annotations


def manage_grpc_errors(c, exc) -> None:
    """pyetcd's own mapping of a gRPC error (it fails the endpoint over), which raises."""
    c._manage_grpc_errors(exc)

"""The modules of the optional ``kubernetes`` extra, imported when first needed.

eft runs without them (a training container needs none); ``eft kubernetes`` needs PyYAML to
write and read manifests and kubernetes-validate (with its jsonschema) to check them, and says
how to install them in one line instead of a traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'elasticft[kubernetes]'"


class MissingExtra(ImportError):
    """A module of the ``kubernetes`` extra is not installed; the message says how to install it."""


def require(module: str) -> ModuleType:
    """``module``, imported; MissingExtra when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{module} is not installed: {INSTALL}") from exc

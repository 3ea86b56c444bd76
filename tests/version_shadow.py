"""An environment in which an installed distribution reports another version.

A ``<name>-<version>.dist-info`` ahead of site-packages on PYTHONPATH is what pip and
``importlib.metadata`` (eft's version checks: ``elasticft/versions.py``) find first; the code
imported is still the installed one. The tests use it to show eft's answers to versions this
machine does not have installed."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reporting(tmp_path: Path, name: str, version: str) -> dict:
    """``os.environ`` with distribution ``name`` reporting ``version`` (the checkout importable too)."""
    site = tmp_path / f"{name}-{version}"
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT),
                                                                        os.environ.get("PYTHONPATH", "")]))}

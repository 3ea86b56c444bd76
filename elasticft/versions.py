"""Which torch, megatron-core and Python eft runs with, read without importing them.

Megatron users train inside containers whose torch is a build of its own: NGC's report
pre-release versions such as ``2.11.0a0+eb65b36914``, which PEP 440 sorts *below* 2.11.0.
eft therefore judges a version by its release part alone (``2.11.0a0+eb65b36914`` is
2.11, and so is ``2.11.0.dev20251201``), in one place, and the launchers ask here before
anything imports torch: an unsupported torch costs one line and exit status 2, never an
import traceback, and a torch newer than the newest tested runs with one line that says so.

A range is (oldest tested minor, newest tested minor). What lies above the newest is
*untested*, not refused: the seams (``torch_seam``, ``megatron_seam``) check what
eft relies on structurally when they are imported, and refuse by name what moved.

This module imports only the standard library: ``eft-run --version`` and the launch check
run before torch is imported, and a broken torch must not stop them.
"""

from __future__ import annotations

import enum
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# Python: enum.StrEnum (the contract's enums) needs 3.11; Megatron-LM itself needs 3.12.
PYTHON = (3, 11)


class Support(enum.StrEnum):
    """Where an installed version stands against a tested range."""

    TESTED = "tested"  # within the range: CI runs it
    UNTESTED = "untested"  # newer than the newest tested: runs, with one line saying so
    UNSUPPORTED = "unsupported"  # older than the oldest, or not installed: refused, exit 2
    ABSENT = "absent"  # not installed, where it is optional


@dataclass(frozen=True)
class Component:
    """A library eft depends on, with the range of minors eft is tested with."""

    name: str  # the distribution's name, as pip knows it
    oldest: tuple[int, int]
    newest: tuple[int, int]
    module_file: str  # where a source install (no metadata) keeps its version: package/file
    patterns: tuple[str, ...]  # how that file writes it: the parts, joined with dots

    def range_text(self) -> str:
        return f"{self.name} {_minor(self.oldest)} to {_minor(self.newest)}"


TORCH = Component("torch", (2, 9), (2, 15), "torch/version.py", (r"^__version__\s*=\s*['\"]([^'\"]+)",))
# Megatron-LM mode: megatron-core's wheel ships megatron.training from 0.17 on.
MEGATRON_CORE = Component("megatron-core", (0, 17), (0, 19), "megatron/core/package_info.py",
                          tuple(rf"^{part}\s*=\s*(\d+)" for part in ("MAJOR", "MINOR", "PATCH")))
# Megatron-Bridge mode (its own loop, megatron.bridge.training): the releases CI's Bridge lane runs.
MEGATRON_BRIDGE = Component("megatron-bridge", (0, 6), (0, 6), "megatron/bridge/package_info.py",
                            tuple(rf"^{part}\s*=\s*(\d+)" for part in ("MAJOR", "MINOR", "PATCH")))


def release(version: str) -> tuple[int, ...] | None:
    """The release part of a version, as numbers: ``2.11.0a0+eb65b36914`` -> (2, 11, 0);
    None when it does not start with one."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def _minor(parts: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in parts[:2])


def installed(component: Component) -> str | None:
    """The installed version (pip's metadata, else the package's own version file: a source
    tree on PYTHONPATH, a container's build installed without metadata); None: not installed."""
    try:
        return importlib.metadata.version(component.name)
    except importlib.metadata.PackageNotFoundError:
        pass
    top = component.module_file.split("/")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root).parent / component.module_file
        if path.is_file():
            text = path.read_text(errors="replace")
            parts = [re.search(pattern, text, re.M) for pattern in component.patterns]
            if all(parts):
                return ".".join(part.group(1) for part in parts)
    return None


@dataclass(frozen=True)
class Verdict:
    """One component's standing, and the one line a user reads about it."""

    component: Component
    version: str | None
    support: Support

    @property
    def line(self) -> str:
        """What the launcher prints (refused or untested), or a plain statement."""
        c, v = self.component, self.version
        if self.support is Support.ABSENT:
            return f"{c.name} is not installed"
        if self.support is Support.UNSUPPORTED and v is None:
            return f"{c.name} is not installed; eft supports {c.range_text()}"
        if self.support is Support.UNSUPPORTED:
            return f"{c.name} {v} is not supported: eft supports {c.range_text()} (release part of the version)"
        if self.support is Support.UNTESTED:
            return f"{c.name} {v} is newer than eft was tested with ({c.range_text()}): running it untested"
        return f"{c.name} {v}: tested ({c.range_text()})"


def judge(component: Component, version: str | None, optional: bool = False) -> Verdict:
    """Where ``version`` of ``component`` stands, by its release part."""
    parts = release(version) if version is not None else None
    if parts is None:
        support = Support.ABSENT if optional and version is None else Support.UNSUPPORTED
    elif parts[:2] < component.oldest:
        support = Support.UNSUPPORTED
    elif parts[:2] > component.newest:
        support = Support.UNTESTED
    else:
        support = Support.TESTED
    return Verdict(component, version, support)


def python_problem(info: tuple[int, ...] = tuple(sys.version_info[:2])) -> str | None:
    """Why this Python cannot run eft, or None."""
    if info < PYTHON:
        return f"Python {_minor(info)} is not supported: eft needs Python >= {_minor(PYTHON)}"
    return None


class SeamError(RuntimeError):
    """An installed library no longer has a name or shape eft relies on (raised by its seam:
    ``torch_seam.TorchSeamError``, ``megatron_seam.MegatronSeamError``). Defined here so that
    a launcher can catch it without importing the library that raised it."""


def eft_version() -> str:
    try:
        return importlib.metadata.version("elasticft")
    except importlib.metadata.PackageNotFoundError:
        return "(a source tree, not installed)"


def standing() -> list[tuple[str, str, str]]:
    """(what, version, where it stands) for eft, Python, torch and megatron-core: what
    ``eft-run --version`` and ``eft doctor`` print, with no import of torch."""
    python = ".".join(str(p) for p in sys.version_info[:3])
    rows = [("eft", eft_version(), ""),
            ("Python", python, python_problem() or f"supported (>= {_minor(PYTHON)})")]
    torch = judge(TORCH, installed(TORCH))
    rows.append(("torch", torch.version or "-", f"{torch.support} ({TORCH.range_text()})"))
    megatron = judge(MEGATRON_CORE, installed(MEGATRON_CORE), optional=True)
    where = (f"{megatron.support} for the Megatron-LM mode ({MEGATRON_CORE.range_text()}; the GPT example: "
             f"0.16 and newer)")
    rows.append(("megatron-core", megatron.version or "-", where))
    return rows

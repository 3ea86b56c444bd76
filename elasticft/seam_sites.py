"""A library's call sites as eft's seams name, check and replace them, written once.

``megatron_seam.py`` (megatron-core and ``megatron.training``) and ``bridge_seam.py``
(Megatron-Bridge) each list the internals eft wraps or calls; what they do with a site is the
same, and lives here: find its function now (``function``), say in words what the installed
library lacks of a list of sites (``missing``), swap a site's function for a wrapper in its
module and in every module that imported it by name (``Swaps.replace``), and bind a call of an
original by parameter name (``Swaps.bound``). Importing this module imports no library.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Iterable

Minor = tuple[int, int]


@dataclass(frozen=True)
class Site:
    """A module-level function of a library's that eft wraps or calls."""

    module: str
    name: str
    params: tuple[str, ...] = ()  # parameters eft's wrapper reads by name, or passes, in every tested release
    # modules that hold the function under the same name (``from module import name``): a wrapper
    # must replace it there too, or their callers go round eft
    imported_by: tuple[str, ...] = ()
    since: tuple[tuple[Minor, tuple[str, ...]], ...] = ()  # (the minor, the parameters relied on from it on)

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"

    def params_in(self, minor: Minor | None) -> tuple[str, ...]:
        """The parameters eft relies on in ``minor`` (None: those of every release)."""
        return self.params + tuple(p for first, added in self.since if minor is not None and minor >= first
                                   for p in added)


def function(site: Site) -> Callable:
    """The function at ``site`` now (the wrapper, once replaced)."""
    return getattr(importlib.import_module(site.module), site.name)


def missing(sites: Iterable[Site], minor: Minor | None = None) -> list[str]:
    """What the installed library lacks of ``sites`` as eft uses them in ``minor``, in words (empty:
    all there): a function gone, a parameter gone, or a module that imported a function by name and
    now holds another (eft's wrapper would not reach that module's callers)."""
    found = []
    for site in sites:
        try:
            target = function(site)
        except (ImportError, AttributeError) as exc:
            found.append(f"{site}: {exc}")
            continue
        params = inspect.signature(inspect.unwrap(target)).parameters
        absent = [p for p in site.params_in(minor) if p not in params]
        if absent:
            found.append(f"{site}: no parameter {', '.join(absent)}")
        found += _elsewhere(site, target)
    return found


def _elsewhere(site: Site, target: Callable) -> list[str]:
    """The modules of ``site.imported_by`` that do not hold ``target`` (nor eft's wrapper of it)."""
    found = []
    for other in site.imported_by:
        try:
            held = getattr(importlib.import_module(other), site.name)
        except (ImportError, AttributeError) as exc:
            found.append(f"{other}.{site.name} (imported from {site.module}): {exc}")
            continue
        if inspect.unwrap(held) is not inspect.unwrap(target):
            found.append(f"{other}.{site.name} is no longer {site}: its callers would go round eft")
    return found


class Swaps:
    """The functions one seam replaced, and their originals' signatures (for ``bound``)."""

    def __init__(self, sites: dict[str, Site], error: type[Exception], seam: str):
        self.sites, self.error, self.seam = sites, error, seam
        self._signatures: dict[str, inspect.Signature] = {}

    def replace(self, name: str, make: Callable[[Callable], Callable]) -> Callable:
        """Swap the function of ``sites[name]`` for ``make(original)`` in its module and in every
        module that imported it by name; the original. Wrappers keep ``__wrapped__``: a second
        replace wraps the first. A site gone, or an importer holding another function, is the
        seam's error, naming what moved: never a wrapper that only some callers reach."""
        site = self.sites[name]
        module = importlib.import_module(site.module)
        original = getattr(module, site.name, None)
        if original is None:
            raise self.error(f"{site} is gone; eft's seam ({self.seam}) needs updating")
        moved = _elsewhere(site, original)
        if moved:
            raise self.error(f"{'; '.join(moved)}; eft's seam ({self.seam}) needs updating")
        self._signatures[name] = inspect.signature(original)
        wrapper = make(original)
        wrapper.__wrapped__ = original
        setattr(module, site.name, wrapper)
        for other in site.imported_by:
            setattr(importlib.import_module(other), site.name, wrapper)
        return original

    def bound(self, name: str, args: tuple, kwargs: dict) -> dict:
        """A call of ``sites[name]``'s original, its arguments by parameter name (the library passes
        some by position, some by keyword)."""
        return dict(self._signatures[name].bind_partial(*args, **kwargs).arguments)

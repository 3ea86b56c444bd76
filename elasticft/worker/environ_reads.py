"""Which environment variables this interpreter's Python code read, by name, and when.

A warm interpreter's site setup and preload run before its worker's environment exists; what
they read then is what a cold start could have acted on otherwise (``warm_interpreter.doubt``).
Watched: reads through ``os.environ`` (``os.environ[...]``, ``.get``, ``os.getenv``, ``in``),
the ways Python code reads one variable; they all go through ``os._Environ.__getitem__``, patched
while watching. Not watched: a C library's ``getenv``, and a walk over the whole environment
(``os.environ.items()``: networkx does it when torch imports it; it sees only the variables that
are there, none that only the worker's environment has, and acts on no rank).
"""

from __future__ import annotations

import os
import sys

_reads: dict[str, str] = {}  # variable -> who read it first (the phase being watched then)
_phase = ""
_unwatched = None  # os._Environ.__getitem__ as it was, while watching


def watch(phase: str) -> None:
    """Record the variables read from now on as read by ``phase`` (e.g. "the site setup")."""
    global _phase, _unwatched
    _phase = phase
    if _unwatched is not None:
        return
    _unwatched = original = os._Environ.__getitem__

    def __getitem__(self, key):
        caller = sys._getframe(1).f_code
        if not (caller.co_name == "__iter__" and "_collections_abc" in caller.co_filename):  # a walk
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            _reads.setdefault(name, _phase)
        return original(self, key)

    os._Environ.__getitem__ = __getitem__


def watching() -> bool:
    return _unwatched is not None


def stop() -> dict[str, str]:
    """Stop watching: the variables read, each with who read it first."""
    global _unwatched
    if _unwatched is not None:
        os._Environ.__getitem__ = _unwatched
        _unwatched = None
    return dict(_reads)

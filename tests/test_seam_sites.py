"""The mechanism both Megatron seams share (elasticft/seam_sites.py), on a library made here:
what the launch check says of a site that moved, and that a wrapper reaches every module that
imported the function by name or is refused, never half-way."""

import sys
import types

import pytest

from elasticft.seam_sites import Site, Swaps, missing


class MovedError(Exception):
    pass


@pytest.fixture
def library():
    """lib.core defines step(model, batch); lib.loop imported it by name (``from lib.core import step``)."""
    core, loop = types.ModuleType("eftlib_core"), types.ModuleType("eftlib_loop")

    def step(model, batch):
        return ("stepped", model, batch)

    core.step = loop.step = step
    sys.modules.update({"eftlib_core": core, "eftlib_loop": loop})
    yield core, loop
    for name in ("eftlib_core", "eftlib_loop"):
        sys.modules.pop(name)


SITE = Site("eftlib_core", "step", ("model", "batch"), imported_by=("eftlib_loop",))


def test_a_wrapper_reaches_the_modules_that_imported_the_function_and_binds_calls_by_name(library):
    core, loop = library
    swaps = Swaps({"step": SITE}, MovedError, "test seam")
    original = swaps.replace("step", lambda f: lambda *a, **k: ("wrapped", f(*a, **k)))
    assert loop.step is core.step and core.step.__wrapped__ is original
    assert loop.step("m", batch="b") == ("wrapped", ("stepped", "m", "b"))
    assert swaps.bound("step", ("m",), {"batch": "b"}) == {"model": "m", "batch": "b"}
    assert missing([SITE]) == []  # eft's own wrapper is still the site's function


def test_a_parameter_gone_or_an_importer_that_holds_another_function_is_named(library):
    core, loop = library
    assert missing([Site("eftlib_core", "step", ("model", "micro_batch"))]) == [
        "eftlib_core.step: no parameter micro_batch"]
    assert missing([Site("eftlib_core", "gone")])[0].startswith("eftlib_core.gone: ")
    loop.step = lambda model, batch: None  # the library moved it, or another tool wrapped it there
    assert missing([SITE]) == ["eftlib_loop.step is no longer eftlib_core.step: its callers would go round eft"]
    before = core.step
    with pytest.raises(MovedError, match="eftlib_loop.step is no longer eftlib_core.step.*test seam"):
        Swaps({"step": SITE}, MovedError, "test seam").replace("step", lambda f: f)
    assert core.step is before  # nothing replaced half-way

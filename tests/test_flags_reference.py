"""docs/flags.md is generated from the knobs by `eft flags`, never written by hand."""

from pathlib import Path

from launcher.eft_run import build_parser
from launcher.flags_cmd import render

PAGE = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def test_the_flags_page_is_what_eft_flags_writes():
    assert PAGE.read_text() == render(), "docs/flags.md is stale: run `eft flags > docs/flags.md`"


def test_every_flag_eft_run_takes_is_on_the_page_with_its_variable():
    page = PAGE.read_text()
    flags = {opt for action in build_parser()._actions for opt in action.option_strings
             if opt.startswith("--eft-")}
    assert flags and not {f for f in flags if f"`{f}`" not in page}
    assert "`EFT_LEASE_TTL` | 3 |" in page  # a knob's variable and default, as the parser has them

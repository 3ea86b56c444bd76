"""``eft flags``: the reference of eft-run's own flags, written from the knobs themselves.

Every knob (``elasticft/config/settings.py``: one dataclass per concern, a field per knob, its
default and one line of help) is a flag, an ``EFT_*`` variable and a default; this page is
generated from them so that it cannot drift: ``eft flags > docs/flags.md``, and
``tests/test_flags_reference.py`` fails when the page and the knobs differ.
"""

from __future__ import annotations

import dataclasses

import typer

from elasticft.config import Settings, env_name, flag_name

HEADER = """# eft-run flags

Generated from the knobs (`elasticft/config/settings.py`) by `eft flags > docs/flags.md`: do not
edit by hand (`tests/test_flags_reference.py` fails when this page and the knobs differ).
Every flag also reads its `EFT_*` variable; a flag on the command line wins over its
variable. torchrun's own flags keep their meaning and their `PET_*` variables
([eft-run](eft-run.md)).
"""


def default_text(value) -> str:
    """A default as the table shows it: on/off for a switch, no trailing .0, (none) for empty."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if value != "" else "(none)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The whole page: one section per concern, one row per knob, in the parser's order."""
    parts = [HEADER]
    for concern in dataclasses.fields(Settings):
        parts.append(f"\n## {concern.metadata['title']}\n")
        parts.append("| flag | variable | default | meaning |\n| --- | --- | --- | --- |")
        for knob in dataclasses.fields(concern.default_factory):
            flag = flag_name(knob.name)
            shown = f"`{flag}` (`--no-{flag[2:]}`)" if isinstance(knob.default, bool) else f"`{flag}`"
            parts.append(f"| {shown} | `{env_name(knob.name)}` | {_cell(default_text(knob.default))} | "
                         f"{_cell(knob.metadata['help'])} |")
    return "\n".join(parts) + "\n"


def register(app: typer.Typer) -> None:
    @app.command("flags")
    def flags() -> None:
        """Print the reference of eft-run's own flags (Markdown), from the knobs themselves."""
        typer.echo(render(), nl=False)

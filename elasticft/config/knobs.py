"""Knobs: how a config dataclass becomes flags, ``EFT_*`` variables and defaults.

Every field of a config dataclass (``elasticft.config``) is a knob with three spellings:
a flag ``--eft-<name>``, an environment variable ``EFT_<NAME>`` and the default written
in the dataclass. ``add_arguments`` turns a dataclass into argparse flags so that the
three can never drift apart; the field's ``help`` metadata is the one line of help.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
from dataclasses import field
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A user-supplied setting is malformed; the message names it and what was expected."""


def knob(default: Any, help: str) -> Any:
    """A config field with its one line of help."""
    return field(default=default, metadata={"help": help})


def flag_name(name: str) -> str:
    return "--eft-" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "EFT_" + name.upper()


def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _converter(default: Any):
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, (int, float)):
        return type(default)
    return str


def convert(name: str, raw: Any, default: Any, source: str) -> Any:
    """Convert ``raw`` to the type of ``default``; a clear ConfigError names ``source``."""
    try:
        return _converter(default)(raw)
    except (TypeError, ValueError):
        kind = type(default).__name__
        raise ConfigError(f"{source}: expected {kind}, got {raw!r}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Add one ``--eft-*`` flag per field of ``cls``; ``EFT_*`` variables set their default."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        env = env_name(f.name)
        default = f.default
        if env in os.environ:
            default = convert(f.name, os.environ[env], f.default, env)
        flag = flag_name(f.name)

        def to_value(raw, _f=f, _flag=flag):
            try:
                return _converter(_f.default)(raw)
            except (TypeError, ValueError):
                raise argparse.ArgumentTypeError(
                    f"expected {type(_f.default).__name__}, got {raw!r}"
                ) from None

        if isinstance(f.default, bool):  # a switch: --eft-x turns it on, --no-eft-x (argparse's) off
            group.add_argument(
                flag,
                dest="eft_" + f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{f.metadata['help']} (env {env}, default {'on' if f.default else 'off'})",
            )
            continue
        group.add_argument(
            flag,
            dest="eft_" + f.name,
            type=to_value,
            default=default,
            help=f"{f.metadata['help']} (env {env}, default {f.default!r})",
        )


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build ``cls`` from the flags added by ``add_arguments``."""
    return cls(**{f.name: getattr(args, "eft_" + f.name) for f in dataclasses.fields(cls)})


def from_env(cls: type[T]) -> T:
    """Build ``cls`` from ``EFT_*`` variables alone (for code that has no parser)."""
    values = {}
    for f in dataclasses.fields(cls):
        env = env_name(f.name)
        if env in os.environ:
            values[f.name] = convert(f.name, os.environ[env], f.default, env)
    return cls(**values)


def signal_number(name: str, knob_name: str) -> int:
    """``SIGUSR1`` or ``USR1`` -> its number; a ConfigError naming the knob otherwise."""
    text = name.strip()
    try:
        return int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])
    except KeyError:
        raise ConfigError(f"{flag_name(knob_name)}: unknown signal {text!r}") from None

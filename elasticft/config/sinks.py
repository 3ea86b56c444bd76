"""``--eft-notify``'s value: where notifications go (a webhook, a command, a file)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name

SINK_KINDS = ("webhook", "command", "file")


@dataclass(frozen=True)
class Sink:
    kind: str  # webhook, command or file
    target: str

    def __str__(self) -> str:
        if self.kind == "webhook":  # the path of a chat webhook is its secret: name the host only
            scheme, _, rest = self.target.partition("://")
            return f"webhook:{scheme}://{rest.split('/', 1)[0]}/..."
        return f"{self.kind}:{self.target}"


def parse_sinks(spec: str) -> list[Sink]:
    """``--eft-notify``'s value: empty, one ``KIND:TARGET`` or a JSON list of them."""
    spec = spec.strip()
    if not spec:
        return []
    if spec.startswith("["):
        try:
            items = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{flag_name('notify')}: not a JSON list of sinks: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{flag_name('notify')}: expected a JSON list of \"KIND:TARGET\" strings")
    else:
        items = [spec]
    sinks = []
    for item in items:
        kind, sep, target = item.partition(":")
        kind = kind.strip()
        if not sep or kind not in SINK_KINDS or not target.strip():
            raise ConfigError(
                f"{flag_name('notify')}: expected KIND:TARGET with KIND one of {', '.join(SINK_KINDS)}, got {item!r}"
            )
        if kind == "webhook" and not target.startswith(("http://", "https://")):
            raise ConfigError(f"{flag_name('notify')}: a webhook needs an http(s) URL, got {target!r}")
        sinks.append(Sink(kind, target.strip()))
    return sinks

"""``MegatronLMConfig``: eft inside an unmodified Megatron-LM script's own loop."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class MegatronLMConfig:
    """eft inside an unmodified Megatron-LM or Megatron-Bridge script's own loop (docs/megatron-lm.md,
    docs/megatron-bridge.md)."""

    megatron_lm: str = knob(
        "auto", "attach eft to megatron.training's loop: auto (when the script imports megatron.training), on, off")
    megatron_bridge: str = knob(
        "auto", "attach eft to Megatron-Bridge's loop: auto (when the script imports megatron.bridge.training), "
        "on, off")

    def __post_init__(self) -> None:
        for name in ("megatron_lm", "megatron_bridge"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ConfigError(f"{flag_name(name)}: expected auto, on or off, got {getattr(self, name)!r}")

"""``MegatronLMConfig``: eft inside an unmodified Megatron-LM script's own loop."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class MegatronLMConfig:
    """eft inside an unmodified Megatron-LM script's own loop (docs/megatron-lm.md)."""

    megatron_lm: str = knob(
        "auto", "attach eft to megatron.training's loop: auto (when the script imports megatron.training), on, off")

    def __post_init__(self) -> None:
        if self.megatron_lm not in ("auto", "on", "off"):
            raise ConfigError(f"{flag_name('megatron_lm')}: expected auto, on or off, got {self.megatron_lm!r}")

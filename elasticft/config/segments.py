"""``SegmentConfig``: which nodes must stay together (an NVLink domain), and how many make a segment."""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob

_DOMAIN = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


@dataclass
class SegmentConfig:
    """Segments (``rendezvous/segments.py``): a round takes whole segments only, so a lost node is
    replaced by a spare of its own domain, or the job re-plans without that segment."""

    segment: int = knob(
        0, "nodes per segment (NVRx's --ft-segment): a round takes only whole segments of this many nodes "
        "of one domain, so a spare replaces a lost node of its own domain or the job re-plans (0: no segments)"
    )
    segment_domain: str = knob(
        "", "this node's domain for --eft-segment (default: the NVLink domain its GPUs' fabric information "
        "names, cluster UUID/clique)"
    )

    def node_segment(self) -> str:
        """This node's domain for its record ("": no segments; launch resolved it otherwise)."""
        return self.segment_domain if self.segment else ""

    def __post_init__(self) -> None:
        if self.segment < 0:
            raise ConfigError(f"{flag_name('segment')}: expected >= 0 (0: no segments), got {self.segment}")
        if self.segment_domain and not _DOMAIN.fullmatch(self.segment_domain):
            raise ConfigError(f"{flag_name('segment_domain')}: expected letters, digits and . _ - : / "
                              f"(at most 128), got {self.segment_domain!r}")

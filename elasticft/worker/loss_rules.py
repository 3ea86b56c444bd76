"""The numbers check's rules, pure: what a bad iteration is, and what its re-run says.

* NaN or Inf in the loss or the gradient norm is always bad.
* A spike is a loss above ``median + max(k * 1.4826 * MAD, min_rise * median)`` of the
  last good losses: the median and the median absolute deviation (scaled to a normal
  distribution's sigma) do not move for one outlier, as a mean and a standard deviation
  would, and the ``min_rise`` floor keeps a flat, quiet curve (MAD near 0) from calling
  noise a spike.
* The re-run of a bad iteration from the last good state: good now → a transient
  fault; the same numbers again (within ``rerun_tolerance``) → the data; other bad
  numbers → the hardware, which stays suspect.

Values travel in the hook's all_reduce(MAX) as int64: the IEEE-754 bits of a
non-negative double order as the number does, and NaN's bits sort above infinity's, so
the MAX of the ranks' bits is the largest value, or NaN if any rank had one.
"""

from __future__ import annotations

import math
import statistics
import struct

from elasticft.contract.numerics import Cause, NumericFault, NumericKind

MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma is 1.4826 median absolute deviations
_NAN_BITS = 0x7FF8_0000_0000_0000


def to_bits(value: float | None) -> int:
    """A positive int64 that orders as ``abs(value)`` (NaN above +Inf); 0 for None. The
    bits are shifted by one so that a loss of exactly 0.0 is not taken for None."""
    if value is None:
        return 0
    value = abs(float(value))
    if math.isnan(value):
        return _NAN_BITS + 1
    return struct.unpack("<q", struct.pack("<d", value))[0] + 1


def from_bits(bits: int) -> float | None:
    """The value ``to_bits`` encoded (None for 0: no rank had one)."""
    if bits == 0:
        return None
    return struct.unpack("<d", struct.pack("<q", bits - 1))[0]


def finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def spike_level(losses: list[float], mads: float, min_rise: float, min_history: int) -> float | None:
    """The loss above which the next one is a spike; None while the window is too short."""
    if len(losses) < min_history:
        return None
    median = statistics.median(losses)
    mad = statistics.median(abs(x - median) for x in losses)
    return median + max(mads * MAD_TO_SIGMA * mad, min_rise * abs(median))


def judge(loss: float | None, grad_norm: float | None, level: float | None) -> NumericKind | None:
    """What is wrong with an iteration's numbers, or None."""
    if not (finite(loss) and finite(grad_norm)):
        return NumericKind.NAN
    if level is not None and loss is not None and loss > level:
        return NumericKind.SPIKE
    return None


def same_numbers(a: float | None, b: float | None, tolerance: float) -> bool:
    """Equal within ``tolerance`` (relative); NaN equals NaN, as a re-run of bad data gives."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return repr(a) == repr(b)
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=0.0)


def rerun_cause(first: NumericFault, kind: NumericKind | None, loss: float | None, grad_norm: float | None,
                tolerance: float) -> Cause | None:
    """What the re-run of ``first``'s iteration says: None if it was good (a transient fault)."""
    if kind is None:
        return None
    if same_numbers(loss, first.loss, tolerance) and same_numbers(grad_norm, first.grad_norm, tolerance):
        return Cause.DATA
    return Cause.HARDWARE

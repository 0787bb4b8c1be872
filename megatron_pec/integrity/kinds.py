"""The two kinds of recorded checksum: a sum64 (``integrity/sum64.py``) is text, "s64:" and 32 hex digits;
older records hold CRC-32 integers. Stdlib only: the agent and the checksum family read it."""

from __future__ import annotations

SUM64_PREFIX = "s64:"


def is_sum64(value) -> bool:
    """Whether a recorded checksum is a sum64, not a CRC-32."""
    return isinstance(value, str) and value.startswith(SUM64_PREFIX)


__all__ = ["SUM64_PREFIX", "is_sum64"]

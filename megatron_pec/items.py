"""Names for the units of state a checkpoint tracks.

An *item* is either the non-expert state of a rank or one expert, identified by
its global (1-based) layer number and its global expert id. Items are stored as
strings in safetensors metadata and manifests, so they have one canonical
spelling here.
"""

from __future__ import annotations

from typing import NamedTuple

NON_EXPERT = "dense"


class ExpertId(NamedTuple):
    layer: int  # global 1-based transformer layer number
    expert: int  # global expert id within the layer

    def __str__(self) -> str:
        return f"L{self.layer}.E{self.expert}"


def item_name(expert: ExpertId | None) -> str:
    """The stored spelling of an item: ``dense`` or ``L<layer>.E<expert>``."""
    return NON_EXPERT if expert is None else str(expert)


def parse_item(name: str) -> ExpertId | None:
    """Inverse of :func:`item_name`; raises ``ValueError`` on anything else."""
    if name == NON_EXPERT:
        return None
    try:
        layer, expert = name.split(".")
        if layer[0] != "L" or expert[0] != "E":
            raise ValueError
        return ExpertId(int(layer[1:]), int(expert[1:]))
    except (ValueError, IndexError):
        raise ValueError(f"not a megatron-pec item name: {name!r}") from None

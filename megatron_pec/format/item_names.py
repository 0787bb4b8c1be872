"""Names for the units of state a checkpoint tracks.

An *item* is either the non-expert state of a rank or one expert, identified by
its global (1-based) layer number and its global expert id. Items are stored as
strings in safetensors metadata and manifests, so they have one canonical
spelling here.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

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


class ExpertOrder:
    """A fixed sequence of experts and each one's position (shared by the arrays laid out in it)."""

    def __init__(self, experts: Sequence[ExpertId], index: dict[ExpertId, int] | None = None):
        self.experts = tuple(experts)
        self.index = index if index is not None else {x: i for i, x in enumerate(self.experts)}

    def __len__(self) -> int:
        return len(self.experts)

    def positions(self, experts):
        """Positions of ``experts`` (all in this order) as a numpy index array."""
        import numpy  # (here: the node agent imports this module, and starts without numpy)

        return numpy.fromiter(map(self.index.__getitem__, experts), dtype=numpy.intp, count=len(experts))

    def extended(self, more: list[ExpertId]) -> "ExpertOrder":
        index = dict(self.index)
        for x in more:
            index.setdefault(x, len(index))
        return ExpertOrder(tuple(index), index)

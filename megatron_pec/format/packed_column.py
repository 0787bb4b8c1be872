"""A per-expert column of a header (item name -> int) in its compact stored form: the names once,
joined by commas, and the values as base64 of little-endian int64, ``ABSENT`` where there is none.

Written at every save for every expert a rank holds (thousands at scale): encoding it is a copy,
not a Python call per expert. Decoded lazily, with the standard library only (the node agent
imports the protocol without numpy or torch).
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Mapping

from megatron_pec.format.json_text import Quoted

ABSENT = -1  # no value: the counters (iterations, token counts) are never negative


class PackedColumn(Mapping):
    def __init__(self, names_text: str, raw: bytes):
        """``raw``: the values as little-endian int64 bytes, one per name."""
        self.names_text = names_text
        self.raw = raw
        self._values: array | None = None
        self._index: dict[str, int] | None = None

    def encoded(self) -> dict[str, str]:
        return {"experts": self.names_text, "values": base64.b64encode(self.raw).decode()}

    def text(self) -> Quoted:
        """``encoded()`` as compact JSON, its names and base64 never escaped (see ``jsontext``)."""
        return Quoted.join([('{"experts":"', False), (self.names_text, True), ('","values":"', False),
                            (self.encoded()["values"], True), ('"}', False)])

    @staticmethod
    def is_packed(data) -> bool:
        return isinstance(data, dict) and set(data) == {"experts", "values"}

    @classmethod
    def decoded(cls, data: dict) -> "PackedColumn":
        """From ``encoded``'s dict; raises ValueError saying what is malformed."""
        names, values = data.get("experts"), data.get("values")
        if not isinstance(names, str) or not isinstance(values, str):
            raise ValueError("'experts' and 'values' must be strings")
        try:
            raw = base64.b64decode(values, validate=True)
        except ValueError:
            raise ValueError("'values' is not base64") from None
        count = names.count(",") + 1 if names else 0
        if len(raw) != 8 * count:
            raise ValueError(f"{count} experts but {len(raw) / 8:g} values")
        return cls(names, raw)

    @property
    def values_array(self) -> array:
        if self._values is None:
            values = array("q", self.raw)
            if sys.byteorder == "big":
                values.byteswap()
            self._values = values
        return self._values

    @property
    def index(self) -> dict[str, int]:
        if self._index is None:
            names = self.names_text.split(",") if self.names_text else []
            self._index = {name: i for i, name in enumerate(names)}
        return self._index

    def __getitem__(self, name: str) -> int:
        value = self.values_array[self.index[name]]
        if value == ABSENT:
            raise KeyError(name)
        return value

    def __iter__(self):
        return (name for name, value in zip(self.index, self.values_array) if value != ABSENT)

    def __len__(self) -> int:
        return len(self.values_array) - self.values_array.count(ABSENT)

    def __repr__(self) -> str:
        return f"PackedColumn({dict(self.items())})"

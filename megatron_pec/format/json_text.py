"""Long JSON text built once: a header's per-expert columns are ~0.5 MB at scale (names and base64),
and escaping them again as a string inside the safetensors metadata scans every byte (~1 ms per
0.4 MB). ``Quoted`` carries its JSON string literal, made from parts that are known to need no
escaping and parts that do; ``dumps_object`` writes a metadata object with those literals as they are.
"""

from __future__ import annotations

import json


class Quoted(str):
    """A str whose JSON string literal (``literal``) was built alongside it."""

    literal: str

    def __new__(cls, text: str, literal: str) -> "Quoted":
        self = super().__new__(cls, text)
        self.literal = literal
        return self

    @classmethod
    def join(cls, parts: list[tuple[str, bool]]) -> "Quoted":
        """``parts``: (text, plain) pairs; plain text has only ASCII characters that JSON strings
        take as they are (no '"', no backslash, no control character), e.g. item names and base64."""
        return cls("".join(text for text, _ in parts),
                   '"' + "".join(text if plain else json.dumps(text)[1:-1] for text, plain in parts) + '"')


def dumps_object(values: dict[str, str]) -> str:
    """``json.dumps(values, separators=(",", ":"))`` for a dict of strings, using the literal of each
    ``Quoted`` value instead of escaping it again."""
    return "{" + ",".join(json.dumps(key) + ":" + (value.literal if isinstance(value, Quoted) else json.dumps(value))
                          for key, value in values.items()) + "}"

"""The small state: everything besides the tensor slices that Megatron's checkpoint holds for a rank,
as one typed, versioned record (``SmallState``).

Made on the training thread at every save (``megatron.collect.small_state``, completed by the adapter),
encoded once, later, by the hand-over thread (``Captured``), stored as the ``small`` field of
``protocol.SlotHeader``, and decoded with validation where a restore reads it (every rank, at restore
only). Its JSON is ``small_state``'s tagged encoding (no pickle) of ``{"v": <version>, <field>: ...}``,
the keys those of the plain dict it replaced: a header written before the record had a version reads as
version 1, whose records may lack the fields added since (they take the defaults below).
"""

from __future__ import annotations

import dataclasses
import threading
import types
import typing
from dataclasses import dataclass

from megatron_pec.format import small_state
from megatron_pec.format.protocol import ProtocolError

__all__ = ["SmallState", "Captured"]

VERSION = 2  # v1: the plain dict without "v" (before the record); v2: "v" and every field present


@dataclass(frozen=True, slots=True)
class SmallState:
    """One rank's small state; the nested values are what Megatron's ``state_dict`` calls return (their
    tensors host copies), kept as the codec round-trips them."""

    iteration: int
    optimizer: dict | list | None      # Megatron's optimizer state_dict (a list when chained); None before a step
    scheduler: dict | None
    rng: dict                          # random, numpy, torch, cuda (once initialised), the tracker's states
    num_floating_point_operations_so_far: float
    consumed_train_samples: int
    skipped_train_samples: int
    consumed_valid_samples: int
    # Fields a version-1 record may lack (written before they existed): missing, they mean these defaults.
    buffers: dict | None = None        # persistent buffers, ``<chunk>/<name>`` -> tensor
    checkpoint_version: float = 3.0
    rng_key_prefix: str = ""           # the rng_state_key_prefix the RNG state was saved under
    frozen: dict | None = None         # frozen parameters by global name
    extra_state: dict | None = None    # modules' extra state (tensors), by global module name
    rerun_state_machine: dict | None = None
    args: dict | None = None           # the arguments check_checkpoint_args compares
    grad_scaler: list | None = None    # per chained optimizer, saved before the first step only

    def as_dict(self) -> dict:
        """What is encoded: the version and every field, by name."""
        return {"v": VERSION, **{name: getattr(self, name) for name in _ACCEPTED}}

    def dumps(self) -> str:
        return small_state.dumps(self.as_dict())

    @classmethod
    def loads(cls, text: str) -> "SmallState":
        """The record in ``text`` (``SlotHeader.small``), or ProtocolError naming the field that is wrong."""
        try:
            data = small_state.loads(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"small state: not a valid encoding ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data) -> "SmallState":
        if not isinstance(data, dict):
            raise ProtocolError(f"small state: expected an object, got {type(data).__name__}")
        fields = dict(data)
        version = fields.pop("v", 1)  # (no "v": written before the record had one)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ProtocolError(f"small state: field 'v' (record version) must be an integer, got {version!r}")
        if version > VERSION:
            raise ProtocolError(f"small state: written by a newer megatron-pec (record version {version}; this one "
                                f"reads up to {VERSION}): upgrade megatron-pec to read it")
        unknown = sorted(set(fields) - set(_ACCEPTED))
        if unknown:
            raise ProtocolError(f"small state: unknown field {unknown[0]!r} (of {len(unknown)}) in a record of "
                                f"version {version}")
        for name, accepted in _ACCEPTED.items():
            if name not in fields:
                if version > 1 or name not in _ADDED_LATER:
                    raise ProtocolError(f"small state: field {name!r} is missing")
            elif not _is(fields[name], accepted):
                raise ProtocolError(f"small state: field {name!r} must be {' or '.join(map(_name, accepted))}, "
                                    f"got {type(fields[name]).__name__}")
        return cls(**fields)


def _accepted(hint) -> tuple[type, ...]:
    """The classes a field's type admits at its top level (an int where a float is: JSON keeps 0 as 0)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    classes = tuple(typing.get_origin(a) or a for a in (typing.get_args(hint) if union else (hint,)))
    return (classes + (int,)) if float in classes else classes


def _is(value, accepted: tuple[type, ...]) -> bool:
    return isinstance(value, accepted) and not (isinstance(value, bool) and bool not in accepted)


def _name(cls: type) -> str:
    return "None" if cls is type(None) else cls.__name__


_ACCEPTED = {name: _accepted(hint) for name, hint in typing.get_type_hints(SmallState).items()}
_ADDED_LATER = {f.name for f in dataclasses.fields(SmallState) if f.default is not dataclasses.MISSING}


class Captured:
    """A save's small state, taken on the training thread and encoded once, when first asked (by the
    hand-over thread, off the training thread). Its parts must not change afterwards: they are the
    copies ``collect.small_state`` makes, not live state."""

    def __init__(self, state: SmallState):
        self._state, self._text = state, None
        self._lock = threading.Lock()

    @property
    def text(self) -> str:
        """The JSON (``SmallState.dumps``)."""
        with self._lock:
            if self._text is None:
                self._text, self._state = self._state.dumps(), None
            return self._text

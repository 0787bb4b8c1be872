"""Every record that crosses a process or file boundary: typed, versioned, validated on decode.

Four families, 30 records, one codec (the sections below, in this order):

* **agent messages** (14; newline-delimited JSON over the node agent's Unix socket):
  trainer -> agent ``Hello`` (with ``JobInfo``, the job constants, once per connection),
  ``Begin`` (the timeline this trainer writes), ``SnapshotReady``, ``Flush``, ``Settle``,
  ``Detach``, ``Stop``; agent -> trainer ``Ready``, ``Begun``, ``Released``, ``Granted``
  (each with its ``Pin`` list), ``Flushed``.
* **node memory** (5): ``SlotHeader`` (the ``__metadata__`` of a slot and of a persisted
  rank file) and ``MemoryIndex`` (the agent's ``slots.json``: ``RankMemory`` per rank, with a
  ``SlotRecord`` per slot and the timeline ``Segment`` list).
* **replication between node agents** (6; TCP, one request per connection): ``PeerAddress``
  (published under --save), ``ReplicaPush``, ``ReplicaPull``, ``ReplicaReply``; a holder's
  ``ReplicaIndex`` of ``ReplicaEntry``.
* **storage** (5): ``NodeMarker`` and ``Manifest`` (the commit marker), each listing ``RankFile``;
  ``RankLayout`` (where each stored tensor lies in the global parameters, its ``GlobalParam``).

``JobKey`` (what must match for node memory to serve a restore) is a plain tuple, not a record.
The small state a ``SlotHeader`` carries (``small``, a string: its tensors and tuples need the tagged
codec of ``small_state``) is a record of its own beside these, ``small_state_record.SmallState``: typed
and versioned, decoded with the same checks and ``ProtocolError`` where a restore reads it.

Each record is encoded with ``type`` and ``v`` (its version). ``decode`` checks both
and every field's type, and raises ``ProtocolError`` naming the record and the field;
a record written by a newer megatron-pec (higher ``v``) is refused with a message
saying so. Pure Python: the node agent imports it without torch.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Mapping

from megatron_pec.format.checkpoint_paths import absolute
from megatron_pec.format.json_text import Quoted
from megatron_pec.format.packed_column import PackedColumn

__all__ = [
    "ProtocolError", "Record", "JobKey", "JobInfo", "Hello", "Ready", "Begin", "Pin", "Begun", "SnapshotReady",
    "Released", "Flush", "Flushed", "Detach", "Stop", "SlotHeader", "SlotRecord", "Segment", "RankMemory",
    "MemoryIndex", "RankFile", "NodeMarker", "Manifest", "PeerAddress", "ReplicaPush", "ReplicaPull", "ReplicaReply",
    "ReplicaEntry", "ReplicaIndex", "GlobalParam", "RankLayout", "decode_message", "LEGACY_FORMAT",
]

LEGACY_FORMAT = "megatron-pec/1"  # manifests and markers written before records carried type and v


class ProtocolError(ValueError):
    """A record that does not decode; the message names the record, the field and what is wrong."""


_SCALARS = (int, str)  # exact types: a bool is not an int here


def _check(value, hint, where: str):
    """``value`` converted to ``hint`` (nested records decoded), or ProtocolError naming ``where``."""
    return _checker(hint)(value, where)


@functools.cache
def _checker(hint):
    """The check of ``_check`` for one ``hint``, worked out once per hint (restores decode thousands of
    records: reading each hint's parts anew per value was most of their time)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        check, optional = _checker(inner), type(None) in args
        return lambda value, where: None if value is None and optional else check(value, where)
    if origin is collections.abc.Mapping:  # a per-expert column: packed, or a JSON object
        return functools.partial(_column, _checker(dict[args]))
    if isinstance(hint, type) and issubclass(hint, Record):
        return functools.partial(_record, hint)
    if origin is list:
        return functools.partial(_listed, args[0] if args[0] in _SCALARS else None, _checker(args[0]))
    if origin is dict:
        return functools.partial(_mapped, args[1] if args[1] in _SCALARS else None, _checker(args[1]))
    if hint is float:
        return _number
    if hint is int:
        return _integer
    if hint in (str, bool):
        return functools.partial(_exactly, hint)
    return lambda value, where: value


def _column(as_dict, value, where: str):
    if isinstance(value, PackedColumn):
        return value
    if not PackedColumn.is_packed(value):
        return as_dict(value, where)
    try:
        return PackedColumn.decoded(value)
    except ValueError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _record(hint, value, where: str):
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be an object, got {type(value).__name__}")
    return hint._from_fields(value, where)


def _listed(scalar, check, value, where: str):
    if not isinstance(value, list):
        raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
    if scalar is not None and set(map(type, value)) <= {scalar}:
        return value  # the common case (thousands of experts), checked in bulk, at C speed
    return [check(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _mapped(scalar, check, value, where: str):
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be an object, got {type(value).__name__}")
    if scalar is not None and set(map(type, value.values())) <= {scalar}:
        return value
    return {k: check(v, f"{where}[{k!r}]") for k, v in value.items()}


def _number(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{where} must be a number, got {value!r}")
    return float(value)


def _integer(value, where: str):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{where} must be an integer, got {value!r}")
    return value


def _exactly(hint, value, where: str):
    if not isinstance(value, hint):
        raise ProtocolError(f"{where} must be a {hint.__name__}, got {value!r}")
    return value


class Record:
    """Base of all records: ``encode`` to a JSON-ready dict, ``decode`` back with validation."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int] = 1

    def encode(self) -> dict:
        return {"type": self.KIND, "v": self.VERSION, **self._fields()}

    def _fields(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def dumps(self) -> str:
        return json.dumps(self.encode(), separators=(",", ":"))

    @classmethod
    def decode(cls, data) -> "Record":
        if not isinstance(data, dict):
            raise ProtocolError(f"{cls.KIND}: expected an object, got {type(data).__name__}")
        if "type" not in data and data.get("format") == LEGACY_FORMAT:
            data = {**data, "type": cls.KIND, "v": 1}
        if data.get("type") != cls.KIND:
            raise ProtocolError(f"{cls.KIND}: field 'type' is {data.get('type')!r}, expected {cls.KIND!r}")
        version = data.get("v")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ProtocolError(f"{cls.KIND}: field 'v' (record version) must be an integer, got {version!r}")
        if version > cls.VERSION:
            raise ProtocolError(f"{cls.KIND}: written by a newer megatron-pec (record version {version}; this one "
                                f"reads up to {cls.VERSION}): upgrade megatron-pec to read it")
        return cls._from_fields(data, cls.KIND)

    @classmethod
    def loads(cls, text: str | bytes) -> "Record":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ProtocolError(f"{cls.KIND}: not valid JSON ({exc})") from None
        return cls.decode(data)

    @classmethod
    def _from_fields(cls, data: dict, where: str) -> "Record":
        values = {}
        for name, required, check in _FIELDS.get(cls) or _fields_of(cls):
            if name not in data:
                if not required:
                    continue
                raise ProtocolError(f"{where}: field {name!r} is missing")
            values[name] = check(data[name], f"{where}: field {name!r}")
        return cls(**values)


_FIELDS: dict[type, list] = {}  # per record class: (field name, required, its check)


def _fields_of(cls) -> list:
    hints = typing.get_type_hints(cls)
    _FIELDS[cls] = [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                     _checker(hints[f.name])) for f in dataclasses.fields(cls)]
    return _FIELDS[cls]


def _plain(value):
    if isinstance(value, Record):
        return value._fields()
    if isinstance(value, PackedColumn):
        return value.encoded()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class JobKey(typing.NamedTuple):
    """What must match for node memory to serve a restore: same job, configuration, --save."""

    job_id: str
    fingerprint: str
    save: str

    @classmethod
    def of(cls, header: "SlotHeader") -> "JobKey":
        return cls(header.job_id, header.fingerprint, absolute(header.save))


# ---- agent messages ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JobInfo(Record):
    """The job constants a trainer tells its agent once per connection."""

    KIND: ClassVar[str] = "job"
    job_id: str
    fingerprint: str          # configuration id: slots and files of another configuration are never mixed
    save: str                 # absolute --save directory
    local_world_size: int
    node_rank: int
    num_nodes: int
    topology: dict[str, int]
    keep: int                 # --pec-keep: committed iterations retained
    replicas: int = 0         # --pec-replicas: copies of each snapshot in other nodes' memory
    domain: str = ""          # this node's failure domain ("" = its own)
    replica_mbps: float | None = None  # send bandwidth cap
    session: str = ""         # this launch of the job (the same on every rank): names its saves' files
    replica_lag: int = 2      # --pec-replica-lag: snapshots a replica may lag before the next snapshot waits
    host: str = ""            # where peer agents reach this node's agent ("": this host's address)
    storage: str = ""         # --pec-storage: the job's one storage, which the agent rebuilds ("": POSIX)

    @property
    def key(self) -> JobKey:
        return JobKey(self.job_id, self.fingerprint, self.save)


@dataclass(frozen=True, slots=True)
class Hello(Record):
    KIND: ClassVar[str] = "hello"
    rank: int
    job: JobInfo


@dataclass(frozen=True, slots=True)
class Ready(Record):
    KIND: ClassVar[str] = "ready"
    pid: int


@dataclass(frozen=True, slots=True)
class Begin(Record):
    """This trainer writes timeline ``run``, which continues from iteration ``resumed_from`` (None: from
    scratch). Every snapshot of any other run after that iteration is abandoned."""

    KIND: ClassVar[str] = "begin"
    run: str
    resumed_from: int | None


@dataclass(frozen=True, slots=True)
class Pin(Record):
    """Regions of node memory the agent needs kept: ``slots``, exactly, where given (what a write or a push
    reads: each of ``items``' region, in order); else those holding versions written at ``iteration`` (of
    ``items`` only, if given), or with ``newest``, each item's newest version up to ``iteration``."""

    KIND: ClassVar[str] = "pin"
    VERSION: ClassVar[int] = 2  # v2: slots
    iteration: int
    items: list[str] | None = None
    newest: bool = False
    slots: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Begun(Record):
    """Answer to ``Begin``: the regions the trainer must not overwrite now (it reads what node memory
    holds from the agent's index, which is current)."""

    KIND: ClassVar[str] = "begun"
    VERSION: ClassVar[int] = 2  # v2: pins instead of whole-slot grants
    pins: list[Pin] = field(default_factory=list)
    hold: str | None = None   # why the next snapshot must wait (a replica lags too far behind), if it must


@dataclass(frozen=True, slots=True)
class SnapshotReady(Record):
    """The complete snapshot of ``iteration``: its header and dense state in slot ``slot`` (its home),
    every other item it wrote in the slot ``places`` names (default: the home)."""

    KIND: ClassVar[str] = "snapshot-ready"
    VERSION: ClassVar[int] = 2  # v2: items in several slots (``places``), ``stale``
    slot: int
    iteration: int
    persist: bool
    persist_items: list[str] | None  # experts to persist besides the dense state; None: all it wrote
    places: dict[str, int] = field(default_factory=dict)
    # Regions that attempts since the last announcement overwrote without announcing them (skipped
    # snapshots): item -> slots; what they held is gone.
    stale: dict[str, list[int]] = field(default_factory=dict)
    generation: str = ""      # a persistent save's generation (``manifest``): the same on every rank


@dataclass(frozen=True, slots=True)
class Released(Record):
    """The agent is done with a snapshot: ``recorded`` (node memory serves it; else its regions hold
    nothing) and persisted, if asked (``error`` says why not); ``pins``: the regions to keep now. A
    persistent snapshot is released twice: once recorded (``persisting``; the regions its write still
    reads are pinned), then when its write ended (``written``)."""

    KIND: ClassVar[str] = "released"
    VERSION: ClassVar[int] = 3  # v2: pins instead of whole-slot grants; v3: persisting, written
    slot: int
    iteration: int
    error: str | None
    recorded: bool
    pins: list[Pin] = field(default_factory=list)
    hold: str | None = None   # why the next snapshot must wait (a replica lags too far behind), if it must
    persisting: bool = False  # recorded, its persist still running: a second Released tells how it ended
    written: bool = False     # that second one: the regions were answered for by the first


@dataclass(frozen=True, slots=True)
class Granted(Record):
    """Unasked: the regions to keep changed (a replica push ended, a newer iteration was persisted).
    Without it a trainer whose saves are all skipped would never hear that regions are free again."""

    KIND: ClassVar[str] = "granted"
    VERSION: ClassVar[int] = 2
    pins: list[Pin] = field(default_factory=list)
    hold: str | None = None   # why the next snapshot must wait (a replica lags too far behind), if it must


@dataclass(frozen=True, slots=True)
class Flush(Record):
    KIND: ClassVar[str] = "flush"


@dataclass(frozen=True, slots=True)
class Settle(Record):
    """A restore is about to read node memory: answer ``Flushed`` once every snapshot announced before
    is recorded (its header checked), without waiting for rank files being written."""

    KIND: ClassVar[str] = "settle"


@dataclass(frozen=True, slots=True)
class Flushed(Record):
    KIND: ClassVar[str] = "flushed"


@dataclass(frozen=True, slots=True)
class Detach(Record):
    KIND: ClassVar[str] = "detach"


@dataclass(frozen=True, slots=True)
class Stop(Record):
    KIND: ClassVar[str] = "stop"


_MESSAGES = {cls.KIND: cls for cls in (Hello, Ready, Begin, Begun, SnapshotReady, Released, Granted, Flush,
                                       Settle, Flushed, Detach, Stop)}


def decode_message(line: str | bytes) -> Record:
    """One agent message of any kind; raises ProtocolError for an unknown or malformed one."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"agent message: not valid JSON ({exc})") from None
    kind = data.get("type") if isinstance(data, dict) else None
    if kind not in _MESSAGES:
        raise ProtocolError(f"agent message: field 'type' is {kind!r}, expected one of {', '.join(_MESSAGES)}")
    return _MESSAGES[kind].decode(data)


# ---- node memory ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SlotHeader(Record):
    """What a snapshot says about itself, in the safetensors ``__metadata__`` (all values strings) of
    its slot and of the rank file persisted from it."""

    KIND: ClassVar[str] = "slot-header"
    job_id: str
    fingerprint: str
    save: str
    rank: int
    world_size: int
    iteration: int
    items: dict[str, int]     # item -> version held (the items this file holds)
    tokens: Mapping[str, int]  # expert item -> cumulative tokens at this iteration (the experts this rank holds)
    small: str                # a SmallState's JSON (small_state_record: optimizer param_groups, scheduler, RNG, ...)
    pec: str                  # PecState JSON (expert versions: the experts this rank holds)
    run: str = ""             # the timeline that wrote it ("" in files of megatron-pec before timelines)
    sums: dict[str, str] = field(default_factory=dict)  # item -> its sum64, computed where its bytes came from

    # v2: ``tokens`` and the PEC state's expert versions cover only the experts of this rank (v1: every
    # expert); a restore merges them over ranks, which reads v1 files too. An older megatron-pec would
    # take a v2 file's partial counts for the whole model: the version makes it refuse instead.
    # v3: ``tokens`` and the PEC state's per-expert values may be packed (``packed_column.PackedColumn``).
    # v4: ``sums``, the items' checksums from the trainer (an older reader would ignore them).
    VERSION: ClassVar[int] = 4
    WRITING: ClassVar[dict[str, str]] = {"type": "slot-header", "v": "4", "state": "writing"}
    _JSON_FIELDS: ClassVar[tuple[str, ...]] = ("items", "tokens", "sums")

    def to_metadata(self) -> dict[str, str]:
        """The safetensors metadata: strings only (dicts as JSON)."""
        out = {"type": self.KIND, "v": str(self.VERSION), "state": "complete"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, PackedColumn):
                out[f.name] = value.text()
            elif isinstance(value, Quoted):
                out[f.name] = value  # (str() would drop its literal)
            else:
                out[f.name] = json.dumps(value, separators=(",", ":")) if f.name in self._JSON_FIELDS else str(value)
        return out

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> "SlotHeader":
        """Raises ProtocolError for a header that is not a complete snapshot's (e.g. one being written)."""
        if meta.get("type") == cls.KIND and meta.get("state") != "complete":
            raise ProtocolError(f"{cls.KIND}: field 'state' is {meta.get('state')!r}: the snapshot is incomplete")
        data = dict(meta)
        for name, value in meta.items():
            if name == "v" or name in ("rank", "world_size", "iteration"):
                try:
                    data[name] = int(value)
                except (TypeError, ValueError):
                    raise ProtocolError(f"{cls.KIND}: field {name!r} must be an integer, got {value!r}") from None
            elif name in cls._JSON_FIELDS:
                try:
                    data[name] = json.loads(value)
                except (TypeError, ValueError):
                    raise ProtocolError(f"{cls.KIND}: field {name!r} is not valid JSON") from None
        return cls.decode(data)

    def with_items(self, items: dict[str, int], sums: dict[str, str] | None = None) -> "SlotHeader":
        return dataclasses.replace(self, items=items, sums=self.sums if sums is None else sums)


@dataclass(frozen=True, slots=True)
class SlotRecord(Record):
    """What one slot file holds, as the agent recorded it: the snapshot whose header and dense state it
    holds (its home: ``iteration`` and ``run``; -1 and "" when none), and every region of it that holds
    a recorded version - the home snapshot's, or another snapshot's expert written here. Also the view
    of one whole snapshot (a replica, an announcement's record): every item at its version."""

    KIND: ClassVar[str] = "slot-record"
    VERSION: ClassVar[int] = 3  # v2: ``sums`` (v1 records hold CRC-32s in ``crcs``); v3: ``runs``
    iteration: int
    run: str
    items: dict[str, int]     # item -> version held
    crcs: dict[str, int] = field(default_factory=dict)  # item -> crc32 of its bytes (records before v2)
    tokens: dict[str, int] = field(default_factory=dict)  # experts -> cumulative tokens at their version
    origin: int | None = None  # the node whose memory it was pulled from (a replica), None: written here
    sums: dict[str, str] = field(default_factory=dict)  # item -> sum64 of its bytes
    runs: dict[str, str] = field(default_factory=dict)  # item -> the run that wrote it, where not ``run``

    def run_of(self, item: str) -> str:
        return self.runs.get(item, self.run)

    @property
    def checks(self) -> dict:
        """item -> its recorded checksum (a sum64, or the CRC-32 of an older record)."""
        return {**self.crcs, **self.sums} if self.crcs else self.sums


@dataclass(frozen=True, slots=True)
class Segment(Record):
    """One stretch of a rank's timeline: snapshots of ``run`` up to iteration ``last`` (None: open)."""

    KIND: ClassVar[str] = "segment"
    run: str
    last: int | None

    def admits(self, run: str, iteration: int) -> bool:
        return run == self.run and (self.last is None or iteration <= self.last)


@dataclass(frozen=True, slots=True)
class RankMemory(Record):
    KIND: ClassVar[str] = "rank-memory"
    VERSION: ClassVar[int] = 3  # v3: regions (slot records of several snapshots), ``job``
    slots: dict[str, SlotRecord] = field(default_factory=dict)
    lineage: list[Segment] = field(default_factory=list)
    job: list[str] = field(default_factory=list)  # the JobKey (job id, fingerprint, --save) that wrote them


@dataclass(frozen=True, slots=True)
class MemoryIndex(Record):
    """``slots.json``: what node memory holds, written only by the node agent."""

    KIND: ClassVar[str] = "memory-index"
    VERSION: ClassVar[int] = 3  # holds v3 rank memories (regions)
    ranks: dict[str, RankMemory] = field(default_factory=dict)


# ---- replication between node agents (TCP) ---------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PeerAddress(Record):
    """Where a node agent accepts replicas (published under --save, one file per node)."""

    KIND: ClassVar[str] = "peer-address"
    node: int
    host: str
    port: int
    domain: str
    pid: int


@dataclass(frozen=True, slots=True)
class ReplicaPush(Record):
    """Node ``node``'s snapshot of ``rank`` (``record``: every item at its version): the slot header
    (``header_len`` bytes) and the bytes of the ``sent`` items (in header order) follow on the socket;
    every other item the holder's replica must already hold at the version ``record`` names."""

    KIND: ClassVar[str] = "replica-push"
    VERSION: ClassVar[int] = 3  # v3: records of regions
    job: JobInfo
    node: int
    rank: int
    record: SlotRecord
    lineage: list[Segment]
    file_len: int
    header_len: int
    sent: list[str]


@dataclass(frozen=True, slots=True)
class ReplicaPull(Record):
    """A node's agent asks a holder for its replica of ``rank`` (after losing its own memory)."""

    KIND: ClassVar[str] = "replica-pull"
    job: JobInfo
    node: int
    rank: int


@dataclass(frozen=True, slots=True)
class ReplicaReply(Record):
    """Answer to a push (``ok`` or the reason) or a pull (then ``file_len`` bytes of the replica follow)."""

    KIND: ClassVar[str] = "replica-reply"
    VERSION: ClassVar[int] = 3  # holds v3 slot records (regions)
    ok: bool
    error: str | None = None
    record: SlotRecord | None = None
    lineage: list[Segment] = field(default_factory=list)
    file_len: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaEntry(Record):
    """A holder's complete replica of one rank of another node."""

    KIND: ClassVar[str] = "replica-entry"
    VERSION: ClassVar[int] = 3  # v3: ``places``
    job_id: str
    fingerprint: str
    save: str
    node: int
    rank: int
    slot: int                 # the replica file holding the snapshot's header and dense state
    record: SlotRecord        # every item at its version
    lineage: list[Segment]
    places: dict[str, int] = field(default_factory=dict)  # item -> replica file holding it, where not ``slot``

    @property
    def key(self) -> JobKey:
        return JobKey(self.job_id, self.fingerprint, self.save)


@dataclass(frozen=True, slots=True)
class ReplicaIndex(Record):
    """``replicas/index.json``: the complete replicas a node agent holds, by "<node>.<rank>"."""

    KIND: ClassVar[str] = "replica-index"
    VERSION: ClassVar[int] = 3  # holds v3 slot records (regions)
    entries: dict[str, ReplicaEntry] = field(default_factory=dict)


# ---- storage -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GlobalParam(Record):
    """A parameter of the model as one rank without model parallelism holds it."""

    KIND: ClassVar[str] = "global-param"
    name: str                 # e.g. decoder.layers.3.mlp.experts.local_experts.17.linear_fc1.weight
    shape: list[int]
    dtype: str                # safetensors code of the stored (main) parameter


@dataclass(frozen=True, slots=True)
class RankLayout(Record):
    """``pec_layout/<fingerprint>/rank_<r>.json``: where every tensor of rank ``rank``'s files lies in
    the model's global parameters. Written once per configuration (the fingerprint names it); read by
    ``export`` and resharding. A stored tensor's name ends in its kind (``.param``, ``.exp_avg``, ...)."""

    KIND: ClassVar[str] = "rank-layout"
    fingerprint: str
    rank: int
    topology: dict[str, int]
    params: list[GlobalParam]
    slices: dict[str, list[int]]  # stored tensor -> [index into params, global flat begin, global flat end]
    buffers: dict[str, str]       # small-state buffer key -> global name
    not_global: str = ""          # why the ranges are not global coordinates ("" when they are)


@dataclass(frozen=True, slots=True)
class RankFile(Record):
    """One persisted rank file and its checksums."""

    KIND: ClassVar[str] = "rank-file"
    VERSION: ClassVar[int] = 2  # v2: ``item_sums`` (v1 entries hold per-item CRC-32s in ``item_crc32``)
    file: str                 # relative to the checkpoint root
    size: int
    crc32: int                # whole file
    items: list[str]
    header_crc32: int
    item_crc32: dict[str, int] = field(default_factory=dict)  # per item (before v2)
    item_sums: dict[str, str] = field(default_factory=dict)   # per item: partial restores check just what they read

    @property
    def item_checks(self) -> dict:
        """item -> its recorded checksum (a sum64, or the CRC-32 of an older file)."""
        return {**self.item_crc32, **self.item_sums} if self.item_crc32 else self.item_sums


@dataclass(frozen=True, slots=True)
class NodeMarker(Record):
    """One node's part of an iteration: written when all its ranks' files are durable."""

    KIND: ClassVar[str] = "node-marker"
    VERSION: ClassVar[int] = 2  # holds v2 slot records / rank files (sum64)
    iteration: int
    node: int
    job_id: str
    fingerprint: str
    topology: dict[str, int]
    ranks: dict[str, RankFile]
    generation: str = ""      # the save it belongs to ("" before generations)


@dataclass(frozen=True, slots=True)
class Manifest(Record):
    """The commit marker of an iteration: it exists iff the iteration is valid."""

    KIND: ClassVar[str] = "manifest"
    VERSION: ClassVar[int] = 2  # holds v2 slot records / rank files (sum64)
    iteration: int
    job_id: str
    fingerprint: str
    topology: dict[str, int]
    num_nodes: int
    world_size: int
    ranks: dict[str, RankFile]
    experts: dict[str, int]                  # expert item -> iteration of its newest persisted version
    sources: dict[str, dict[str, RankFile]]  # older iteration -> rank -> file still holding needed versions
    generation: str = ""                     # the save committed ("" before generations)

    def file_of(self, version: int, rank: int) -> RankFile | None:
        """The rank file of ``rank`` written at ``version`` (this iteration or a referenced older one)."""
        files = self.ranks if version == self.iteration else self.sources.get(str(version), {})
        return files.get(str(rank))

"""Every record that crosses a process or file boundary: round trip, and refusal of a malformed or
newer-version record with a message naming the record and the field. Pure unit tests."""

import dataclasses
import json

import pytest

from megatron_pec.format import protocol as p

pytestmark = pytest.mark.megatron_free

FILE = p.RankFile(file="iter_0000010/pec/rank_00000.safetensors", size=4096, crc32=0xDEADBEEF,
                  items=["L1.E0", "dense"], header_crc32=7, item_sums={"L1.E0": "s64:" + "1" * 32,
                                                                       "dense": "s64:" + "2" * 32})
OLD_FILE = p.RankFile(file="iter_0000010/pec/rank_00001.safetensors", size=4096, crc32=0xDEADBEEF,
                      items=["L1.E0", "dense"], header_crc32=7, item_crc32={"L1.E0": 1, "dense": 2})
JOB = p.JobInfo(job_id="job", fingerprint="0123abcd", save="/ckpt", local_world_size=2, node_rank=1, num_nodes=2,
                topology={"tp": 1, "ep": 2, "dp": 2}, keep=2)
RECORD = p.SlotRecord(iteration=12, run="r1", items={"dense": 12, "L1.E0": 10},
                      sums={"dense": "s64:" + "5" * 32, "L1.E0": "s64:" + "6" * 32}, tokens={"L1.E0": 900},
                      runs={"L1.E0": "r0"})
OLD_RECORD = p.SlotRecord(iteration=12, run="r1", items={"dense": 12, "L1.E0": 10}, crcs={"dense": 5, "L1.E0": 6},
                          tokens={"L1.E0": 900})
PIN = p.Pin(iteration=7, items=["dense"], newest=False)

# One instance of every record, and a field of it to break (with a value of the wrong type).
SAMPLES = [
    (JOB, "num_nodes", "two"),
    (p.Hello(rank=3, job=JOB), "rank", None),
    (p.Ready(pid=4242), "pid", "4242"),
    (p.Begin(run="r1", resumed_from=10), "run", 5),
    (p.Begin(run="r2", resumed_from=None), "resumed_from", "10"),
    (PIN, "iteration", "7"),
    (p.Begun(pins=[PIN, p.Pin(9, None, newest=True)]), "pins", [0]),
    (p.SnapshotReady(slot=1, iteration=12, persist=True, persist_items=["L1.E3"], places={"L1.E0": 2}), "slot", "1"),
    (p.SnapshotReady(slot=2, iteration=13, persist=False, persist_items=None, stale={"L1.E1": [0]}), "persist",
     "yes"),
    (p.SnapshotReady(slot=2, iteration=13, persist=False, persist_items=None, places={"L1.E1": 1}), "places",
     {"L1.E1": "1"}),
    (p.Released(slot=1, iteration=12, error=None, recorded=True, pins=[PIN]), "iteration", 12.5),
    (p.Released(slot=1, iteration=12, error="OSError: [Errno 28] No space left", recorded=False), "error", 28),
    (p.Released(slot=1, iteration=12, error=None, recorded=True), "recorded", 1),
    (p.Granted(pins=[PIN]), "pins", "2"),
    (p.Flush(), None, None),
    (p.Flushed(), None, None),
    (p.Detach(), None, None),
    (p.Stop(), None, None),
    (RECORD, "sums", {"dense": 5}),
    (OLD_RECORD, "crcs", {"dense": "5"}),
    (p.Segment(run="r1", last=None), "last", "open"),
    (p.RankMemory(slots={"0": RECORD}, lineage=[p.Segment("r0", 8), p.Segment("r1", None)]), "lineage", {}),
    (p.MemoryIndex(ranks={"0": p.RankMemory(slots={"1": RECORD})}), "ranks", []),
    (FILE, "size", True),
    (OLD_FILE, "item_crc32", {"dense": "2"}),
    (p.NodeMarker(iteration=10, node=1, job_id="job", fingerprint="f", topology={"ep": 2}, ranks={"2": FILE}),
     "ranks", {"2": {"file": "x"}}),
    (p.Manifest(iteration=20, job_id="job", fingerprint="f", topology={"ep": 2}, num_nodes=2, world_size=4,
                ranks={"0": FILE}, experts={"L1.E0": 10}, sources={"10": {"0": FILE}}), "experts", {"L1.E0": "10"}),
]
IDS = [f"{type(r).__name__}-{field}" for r, field, _ in SAMPLES]


@pytest.mark.parametrize("record,field,bad", SAMPLES, ids=IDS)
def test_round_trip(record, field, bad):
    text = record.dumps()
    assert type(record).loads(text) == record
    if type(record).KIND in {k.KIND for k in (p.Hello, p.Ready, p.Begin, p.Begun, p.SnapshotReady, p.Released,
                                               p.Granted, p.Flush, p.Flushed, p.Detach, p.Stop)}:
        assert p.decode_message(text) == record


@pytest.mark.parametrize("record,field,bad", [s for s in SAMPLES if s[1] is not None],
                         ids=[i for i, s in zip(IDS, SAMPLES) if s[1] is not None])
def test_malformed_field_is_refused_naming_the_field(record, field, bad):
    data = record.encode()
    data[field] = bad
    with pytest.raises(p.ProtocolError, match=rf"^{record.KIND}: field '{field}'"):
        type(record).decode(data)
    del data[field]
    spec = {f.name: f for f in dataclasses.fields(record)}[field]
    if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
        with pytest.raises(p.ProtocolError, match=rf"^{record.KIND}: field '{field}' is missing"):
            type(record).decode(data)
    else:  # optional: an absent field takes its default
        assert getattr(type(record).decode(data), field) == spec.default_factory()


@pytest.mark.parametrize("record,field,bad", SAMPLES, ids=IDS)
def test_newer_version_and_wrong_type_are_refused(record, field, bad):
    data = record.encode()
    newer = record.VERSION + 1
    with pytest.raises(p.ProtocolError, match=rf"{record.KIND}: written by a newer megatron-pec \(record version "
                                              rf"{newer}; this one reads up to {record.VERSION}\): upgrade"):
        type(record).decode({**data, "v": newer})
    with pytest.raises(p.ProtocolError, match=rf"^{record.KIND}: field 'v'"):
        type(record).decode({**data, "v": "1"})
    other = p.Stop if not isinstance(record, p.Stop) else p.Flush
    with pytest.raises(p.ProtocolError, match=rf"^{other.KIND}: field 'type' is '{record.KIND}'"):
        other.decode(data)


def test_nested_field_errors_name_the_path():
    data = p.Manifest(iteration=20, job_id="j", fingerprint="f", topology={}, num_nodes=1, world_size=1,
                      ranks={"0": FILE}, experts={}, sources={}).encode()
    data["ranks"]["0"]["crc32"] = "abc"
    with pytest.raises(p.ProtocolError, match=r"manifest: field 'ranks'\['0'\]: field 'crc32' must be an integer"):
        p.Manifest.decode(data)


def test_unknown_messages_and_bad_json_are_refused():
    with pytest.raises(p.ProtocolError, match="field 'type' is 'shout', expected one of hello"):
        p.decode_message(json.dumps({"type": "shout", "v": 1}))
    with pytest.raises(p.ProtocolError, match="not valid JSON"):
        p.decode_message("{half")
    with pytest.raises(p.ProtocolError, match="manifest: not valid JSON"):
        p.Manifest.loads(b"\x00garbage")


def test_legacy_files_without_type_decode_as_version_1():
    """Manifests and markers written before records carried ``type``/``v`` (format megatron-pec/1)."""
    data = p.NodeMarker(iteration=10, node=0, job_id="j", fingerprint="f", topology={}, ranks={"0": FILE}).encode()
    del data["type"], data["v"]
    data["format"] = p.LEGACY_FORMAT
    assert p.NodeMarker.decode(data).ranks["0"] == FILE
    data["format"] = "megatron-pec/9"
    with pytest.raises(p.ProtocolError, match="field 'type' is None"):
        p.NodeMarker.decode(data)


def test_slot_header_round_trips_as_safetensors_metadata():
    header = p.SlotHeader(job_id="j", fingerprint="f", save="/ckpt", rank=3, world_size=4, iteration=12,
                          items={"dense": 12, "L1.E0": 12}, tokens={"L1.E0": 77}, small="{}", pec="{}", run="r1")
    meta = header.to_metadata()
    assert all(isinstance(v, str) for v in meta.values())  # safetensors allows strings only
    assert p.SlotHeader.from_metadata(meta) == header
    with pytest.raises(p.ProtocolError, match="field 'state' is 'writing': the snapshot is incomplete"):
        p.SlotHeader.from_metadata(p.SlotHeader.WRITING)
    with pytest.raises(p.ProtocolError, match="slot-header: field 'iteration' must be an integer, got 'twelve'"):
        p.SlotHeader.from_metadata({**meta, "iteration": "twelve"})
    with pytest.raises(p.ProtocolError, match="slot-header: field 'items' is not valid JSON"):
        p.SlotHeader.from_metadata({**meta, "items": "{"})
    with pytest.raises(p.ProtocolError, match="slot-header: field 'job_id' is missing"):
        p.SlotHeader.from_metadata({k: v for k, v in meta.items() if k != "job_id"})
    with pytest.raises(p.ProtocolError, match="record version 5"):
        p.SlotHeader.from_metadata({**meta, "v": "5"})
    # v1 (every expert's counts in every rank's file), v2 (JSON-object counts) and v3 (no sums) still read
    old = {k: v for k, v in meta.items() if k != "sums"}
    for version in ("1", "2", "3"):
        assert p.SlotHeader.from_metadata({**old, "v": version}) == header
    fields = ("job_id", "fingerprint", "save", "rank", "world_size", "iteration", "items", "tokens", "small", "pec",
              "run")
    summed = p.SlotHeader(**{**{f: getattr(header, f) for f in fields},
                             "sums": {"dense": "s64:" + "0" * 32}})
    assert p.SlotHeader.from_metadata(summed.to_metadata()) == summed


def test_slot_header_packs_per_expert_token_counts():
    """A save writes the token counts of a rank's experts packed (the names once, the values as base64);
    they read back as the same mapping, and a malformed column is a ProtocolError naming the field."""
    from megatron_pec.format.packed_column import PackedColumn

    raw = b"".join(v.to_bytes(8, "little", signed=True) for v in (77, -1, 2**40))
    header = p.SlotHeader(job_id="j", fingerprint="f", save="/ckpt", rank=3, world_size=4, iteration=12,
                          items={"dense": 12}, tokens=PackedColumn("L1.E0,L1.E1,L2.E0", raw), small="{}", pec="{}")
    meta = header.to_metadata()
    assert '"experts":"L1.E0,L1.E1,L2.E0"' in meta["tokens"]
    back = p.SlotHeader.from_metadata(meta)
    assert dict(back.tokens) == {"L1.E0": 77, "L2.E0": 2**40} and back == header  # (-1: no count)
    assert back.tokens.get("L1.E1") is None and back.tokens["L2.E0"] == 2**40
    assert p.SlotHeader.loads(header.dumps()) == header
    short = meta["tokens"].replace('"L1.E0,L1.E1,L2.E0"', '"L1.E0,L1.E1,L2.E0,L3.E0"')
    with pytest.raises(p.ProtocolError, match="slot-header: field 'tokens': 4 experts but 3 values"):
        p.SlotHeader.from_metadata({**meta, "tokens": short})
    with pytest.raises(p.ProtocolError, match="field 'tokens': 'values' is not base64"):
        p.SlotHeader.from_metadata({**meta, "tokens": '{"experts":"L1.E0","values":"***"}'})

"""safetensors layout and the small-state codec: pure unit tests."""

import json
import os
import struct

import pytest
import torch

from megatron_pec.format import small_state
from megatron_pec.format.stformat import FormatError, decode_header, encode_header, layout, tensor_view
from megatron_pec.memory.slot_map import SlotMap

pytestmark = pytest.mark.megatron_free


def test_header_is_strict_safetensors():
    entries = layout([("dense/a.param", torch.float32, 3), ("L1.E0/b.exp_avg", torch.bfloat16, 5)])
    head = encode_header(entries, {"iteration": "7"})
    (n,) = struct.unpack("<Q", head[:8])
    assert n % 8 == 0 and head[8:9] == b"{" and len(head) == 8 + n
    data = bytearray(head + bytes(entries[-1].end))
    header = decode_header(data, file_len=len(data))
    assert [e.item for e in header.tensors] == ["dense", "L1.E0"]
    assert header.metadata == {"iteration": "7"}
    body = json.loads(head[8:].decode())
    assert body["dense/a.param"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    view = tensor_view(data, header, header.tensors[0])
    view.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert struct.unpack("<3f", bytes(data[header.data_start:header.data_start + 12])) == (1.0, 2.0, 3.0)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:20], "header length"),
    (lambda b: b + b"x", "bytes but its header describes"),
    (lambda b: b[:8] + b"[" + b[9:], "does not start with"),
    (lambda b: b[:8 + 127] + b"x" + b[8 + 128:], "other than space padding"),  # the last padding byte
    (lambda b: b[:8 + 30] + b" " * 98 + b[8 + 128:], "not valid JSON"),  # a torn header: braces lost
])
def test_malformed_files_are_rejected(mutate, message):
    entries = layout([("dense/a.param", torch.float32, 4)])
    good = encode_header(entries, {}, capacity=128) + bytes(16)
    bad = mutate(good)
    with pytest.raises(FormatError, match=message):
        decode_header(bad, file_len=len(bad))


def test_small_state_round_trip_without_pickle():
    state = {"param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "step": 6.0, "params": [0, 1]}],
             "rng": torch.get_rng_state(), "nan": float("nan"), 3: None, "nested": [(1, "a")]}
    back = small_state.loads(small_state.dumps(state))
    assert back["param_groups"] == state["param_groups"]
    assert torch.equal(back["rng"], state["rng"]) and back["rng"].dtype == torch.uint8
    assert back[3] is None and back["nested"] == [(1, "a")] and back["nan"] != back["nan"]
    with pytest.raises(TypeError, match="cannot store a object"):
        small_state.dumps({"x": object()})


def test_slot_header_keeps_its_table_and_blanks_longer_metadata(tmp_path):
    """A save rewrites only the metadata after the slot's tensor table; shorter metadata after longer
    leaves no stale bytes behind, and a re-opened slot (another process) finds its table in place."""
    from megatron_pec.memory.slots import SlotFiles, open_slot

    entries = layout([("dense/w.param", torch.float32, 4), ("L1.E0/w.param", torch.float32, 2)])
    files = SlotFiles(str(tmp_path), 0, SlotMap.of(entries, 2), 1, reserve=4096)
    files.write_header(0, {"iteration": "1", "tokens": "x" * 3000})
    files.write_header(0, {"iteration": "2"})
    files.close()
    mapping, header = open_slot(str(tmp_path / "rank0.slot0"))
    mapping.close()
    assert header.metadata == {"iteration": "2"} and [e.name for e in header.tensors] == ["dense/w.param"]
    again = SlotFiles(str(tmp_path), 0, SlotMap.of(entries, 2), 1, reserve=4096)
    again.write_header(0, {"iteration": "3"})
    again.close()
    mapping, header = open_slot(str(tmp_path / "rank0.slot0"))
    mapping.close()
    assert header.metadata == {"iteration": "3"}
    with pytest.raises(FormatError, match="more than the"):
        small = SlotFiles(str(tmp_path / "small"), 0, SlotMap.of(entries, 2), 1, reserve=64)
        small.write_header(1, {"tokens": "x" * (small.capacity + 1)})


def test_a_header_another_process_wrote_into_a_new_slot_is_blanked_by_the_next_save(tmp_path):
    """A replacement node's agent pulls a peer's replica into home slot 0 after the trainer created the
    slot files (``replica_transport._land``: a whole header, metadata longer than the empty one the
    trainer wrote): the trainer's next, shorter, header there leaves none of it behind (it did once:
    "header is not valid JSON (Extra data ...)", the snapshot unrecorded)."""
    from megatron_pec.format.stformat import encode_header
    from megatron_pec.memory.slots import SlotFiles, open_slot

    entries = layout([("dense/w.param", torch.float32, 4), ("L1.E0/w.param", torch.float32, 2)])
    files = SlotFiles(str(tmp_path), 0, SlotMap.of(entries, 2), 1, reserve=4096)  # new files
    files.maps[0][:8 + files.capacity] = encode_header(files.header.tensors, {"iteration": "5", "tokens": "x" * 300},
                                                       capacity=files.capacity)  # the pull, from the agent
    files.write_header(0, {"iteration": "7"})
    files.close()
    mapping, header = open_slot(str(tmp_path / "rank0.slot0"))
    mapping.close()
    assert header.metadata == {"iteration": "7"}


def test_a_restart_keeps_the_slots_header_size(tmp_path):
    """The header reserve is partly measured at start-up; a restart that measures a little less or more
    keeps the existing slots' header size (or the snapshots in them would no longer line up)."""
    from megatron_pec.memory.slots import HEADER_ALIGN, SlotFiles

    entries = SlotMap.of(layout([("dense/w.param", torch.float32, 4)]), 0)
    first = SlotFiles(str(tmp_path), 0, entries, 1, reserve=HEADER_ALIGN + 100)
    first.write_header(0, {"iteration": "7"})
    first.close()
    again = SlotFiles(str(tmp_path), 0, entries, 1, reserve=HEADER_ALIGN - 100)
    assert again.capacity == first.capacity
    again.close()
    bigger = SlotFiles(str(tmp_path), 0, entries, 1, reserve=3 * HEADER_ALIGN)
    assert bigger.capacity > first.capacity  # too small for this run: the slots are rebuilt
    bigger.close()


def test_a_header_beyond_the_limit_is_refused_at_start_up(tmp_path):
    from megatron_pec.format.stformat import MAX_HEADER
    from megatron_pec.memory.slots import SlotFiles, SlotSpaceError

    entries = SlotMap.of(layout([("dense/w.param", torch.float32, 4)]), 0)
    with pytest.raises(SlotSpaceError, match="spread the experts over more ranks"):
        SlotFiles(str(tmp_path), 0, entries, 1, reserve=MAX_HEADER)
    assert not list(tmp_path.iterdir())  # refused before any slot file exists


def test_the_fast_checksum_is_zlibs_crc32():
    """Files written with zlib-ng's crc32 must check under zlib's and back (same CRC-32, chained
    across pieces the way streamed reads and writes compute it)."""
    import random
    import zlib

    from megatron_pec.integrity import checksum

    assert checksum.IMPLEMENTATION == "zlib-ng", "zlib-ng is a dependency (pyproject.toml): reinstall the package"
    data = random.Random(7).randbytes(3 << 20)
    assert checksum.crc32(data) == zlib.crc32(data)
    chained = 0
    for begin in range(0, len(data), 1 << 20 | 17):
        chained = checksum.crc32(memoryview(data)[begin:begin + (1 << 20 | 17)], chained)
    assert chained == zlib.crc32(data)
    assert checksum.crc32(b"") == 0


def test_metadata_alone_and_a_known_table_decode_as_the_full_header():
    """A restore chooses slots by their metadata only and skips parsing the table its own process
    wrote; both must agree with the full strict decode, and a different table is parsed in full."""
    from megatron_pec.format.stformat import decode_metadata, tensor_table

    entries = layout([("dense/a.param", torch.float32, 4), ("L1.E0/b.param", torch.float32, 2)])
    metadata = {"iteration": "7", "small": json.dumps({"quote": '"__metadata__":{}', "x": [1, 2]})}
    head = encode_header(entries, metadata, capacity=4096)
    full = decode_header(head)
    assert decode_metadata(head) == full.metadata == metadata
    known = (tensor_table(entries), entries)
    assert decode_header(head, known=known) == full
    other = layout([("dense/a.param", torch.float32, 4), ("L1.E0/b.param", torch.float32, 2),
                    ("L1.E1/c.param", torch.float32, 1)])
    longer = encode_header(other, metadata, capacity=4096)  # starts with the known table's bytes
    assert decode_header(longer, known=known).tensors == other
    # safetensors allows __metadata__ anywhere in the object: the metadata alone is still found
    body = json.dumps({"__metadata__": {"iteration": "3"}, "dense/a.param": {
        "dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    assert decode_metadata(struct.pack("<Q", len(body)) + body) == {"iteration": "3"}


def test_the_agents_slot_cache_keeps_a_mapping_and_its_table_until_the_file_changes(tmp_path):
    """The agent reads every snapshot's slot through its cache: the same header as a full parse, the
    mapping and parsed table reused while the file stays, both anew for a slot of another
    configuration (resized in place: a stale mapping of it would fault past its end)."""
    from megatron_pec.memory.slots import SlotCache, SlotFiles, open_slot, slot_path

    entries = layout([("dense/w.param", torch.float32, 4), ("L1.E0/w.param", torch.float32, 2)])
    files = SlotFiles(str(tmp_path), 0, SlotMap.of(entries, 2), 1, reserve=4096)
    files.write_header(0, {"iteration": "1"})
    path, cache = slot_path(str(tmp_path), 0, 0), SlotCache()
    first_map, first = cache.open(path)
    files.write_header(0, {"iteration": "2"})
    second_map, second = cache.open(path)
    plain_map, plain = open_slot(path)
    plain_map.close()
    assert second_map is first_map and second.tensors is first.tensors
    assert second == plain and second.metadata == {"iteration": "2"}
    files.close()
    other = layout([("dense/w.param", torch.float32, 300), ("L1.E0/w.param", torch.float32, 2)])
    files = SlotFiles(str(tmp_path), 0, SlotMap.of(other, 2), 1, reserve=4096)  # another configuration
    files.write_header(0, {"iteration": "5"})
    third_map, third = cache.open(path)
    files.close()
    assert third_map is not first_map and len(third_map) == os.path.getsize(path)
    assert third.tensors == other[:1] and third.metadata == {"iteration": "5"}


def test_quoted_text_encodes_as_json_dumps_does():
    """A header's long per-expert text carries its JSON literal (built from parts, the long ones never
    escaped): the metadata object it lands in reads back exactly as one written by ``json.dumps``."""
    import json

    from megatron_pec.format.json_text import Quoted, dumps_object

    quoted = Quoted.join([('{"experts":"', False), ("L1.E0,L1.E1", True), ('","values":"', False),
                          ("AAEC+/==", True), ('"} tab\t, quote", backslash\\ and é', False)])
    assert quoted == '{"experts":"L1.E0,L1.E1","values":"AAEC+/=="} tab\t, quote", backslash\\ and é'
    assert quoted.literal == json.dumps(str(quoted))
    metadata = {"pec": quoted, "plain": 'with "quotes"\n', "é": "x"}
    assert dumps_object(metadata) == json.dumps(metadata, separators=(",", ":"))
    assert json.loads(dumps_object(metadata)) == metadata

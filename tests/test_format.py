"""safetensors layout and the small-state codec: pure unit tests."""

import json
import struct

import pytest
import torch

from megatron_pec import smallstate
from megatron_pec.stformat import FormatError, decode_header, encode_header, layout, tensor_view


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
])
def test_malformed_files_are_rejected(mutate, message):
    entries = layout([("dense/a.param", torch.float32, 4)])
    good = encode_header(entries, {}) + bytes(16)
    bad = mutate(good)
    with pytest.raises(FormatError, match=message):
        decode_header(bad, file_len=len(bad))


def test_small_state_round_trip_without_pickle():
    state = {"param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "step": 6.0, "params": [0, 1]}],
             "rng": torch.get_rng_state(), "nan": float("nan"), 3: None, "nested": [(1, "a")]}
    back = smallstate.loads(smallstate.dumps(state))
    assert back["param_groups"] == state["param_groups"]
    assert torch.equal(back["rng"], state["rng"]) and back["rng"].dtype == torch.uint8
    assert back[3] is None and back["nested"] == [(1, "a")] and back["nan"] != back["nan"]
    with pytest.raises(TypeError, match="cannot store a object"):
        smallstate.dumps({"x": object()})

"""The small state as a typed, versioned record (``format.small_state_record``): pure unit tests. A round
trip keeps every field and its values' types; a missing, unknown or mistyped field and a newer version are
refused naming what is wrong; a header's small state written before the record had a version still reads."""

import json
import struct
from pathlib import Path

import numpy
import pytest
import torch

from megatron_pec.format.protocol import ProtocolError
from megatron_pec.format.small_state_record import VERSION, Captured, SmallState

pytestmark = pytest.mark.megatron_free

PREVIOUS = Path(__file__).parent / "fixtures" / "previous_format" / "checkpoint" / "iter_0000008" / "pec"


def full_state(**changes) -> SmallState:
    fields = dict(
        iteration=8,
        optimizer=[{"optimizer": {"param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "step": 6}]}}],
        scheduler={"max_lr": 0.002, "num_steps": 64},
        rng={"random": (3, tuple(range(625)), None), "torch": torch.get_rng_state(), "tracker": {},
             "numpy": ("MT19937", numpy.arange(4, dtype=numpy.uint32), 1, 0, 0.0)},
        num_floating_point_operations_so_far=0,
        consumed_train_samples=64, skipped_train_samples=0, consumed_valid_samples=0,
        buffers={"0/decoder.layers.0.mlp.router.expert_bias": torch.arange(4, dtype=torch.float32)},
        checkpoint_version=3.0, rng_key_prefix="",
        frozen={"0/embedding.weight": torch.ones(2, 3, dtype=torch.bfloat16)},
        extra_state={"0/decoder.layers.0.linear_fc1._extra_state": torch.arange(5, dtype=torch.uint8)},
        rerun_state_machine={"mode": {"__enum__": "RerunMode", "name": "DISABLED"}},
        args={"num_layers": 2, "global_batch_size": 8}, grad_scaler=None)
    return SmallState(**{**fields, **changes})


def encoded(**changes) -> str:
    """The JSON of ``full_state`` with top-level keys replaced (``None``: removed)."""
    data = json.loads(full_state().dumps())
    for key, value in changes.items():
        if value is None:
            del data["__dict__"][key]
        else:
            data["__dict__"][key] = value
    return json.dumps(data)


def test_a_round_trip_keeps_every_field_and_its_values_types():
    state = full_state()
    back = SmallState.loads(state.dumps())
    assert back.dumps() == state.dumps()
    assert (back.iteration, back.scheduler, back.args, back.grad_scaler) == (8, state.scheduler, state.args, None)
    assert type(back.num_floating_point_operations_so_far) is int  # (0 stays 0: a resave writes what was read)
    assert back.optimizer[0]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back.rng["random"] == state.rng["random"] and torch.equal(back.rng["torch"], state.rng["torch"])
    for name in ("buffers", "frozen", "extra_state"):
        (key, tensor), = getattr(state, name).items()
        assert torch.equal(getattr(back, name)[key], tensor) and getattr(back, name)[key].dtype == tensor.dtype
    plain = full_state(rng={"random": (3, (1, 2), None)}, buffers={}, frozen=None, extra_state=None)
    assert SmallState.loads(plain.dumps()) == plain
    assert json.loads(state.dumps())["__dict__"]["v"] == VERSION


@pytest.mark.parametrize("name", ["rng", "iteration", "frozen", "args", "rng_key_prefix"])
def test_a_missing_field_is_refused_naming_it(name):
    with pytest.raises(ProtocolError, match=f"small state: field '{name}' is missing"):
        SmallState.loads(encoded(**{name: None}))


@pytest.mark.parametrize("name, value, expected", [
    ("iteration", "8", "int"), ("iteration", True, "int"), ("rng", [1, 2], "dict"),
    ("optimizer", "x", "dict or list or None"), ("rng_key_prefix", 1, "str"),
    ("num_floating_point_operations_so_far", False, "float or int"), ("grad_scaler", {"__dict__": {}}, "list or None"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_it(name, value, expected):
    with pytest.raises(ProtocolError, match=f"small state: field '{name}' must be {expected}, got"):
        SmallState.loads(encoded(**{name: value}))


def test_an_unknown_field_a_newer_version_and_a_bad_encoding_are_refused():
    with pytest.raises(ProtocolError, match="small state: unknown field 'experts'"):
        SmallState.loads(encoded(experts=3))
    with pytest.raises(ProtocolError, match=rf"written by a newer megatron-pec \(record version {VERSION + 1}; "
                                            rf"this one reads up to {VERSION}\)"):
        SmallState.loads(encoded(v=VERSION + 1))
    with pytest.raises(ProtocolError, match="field 'v' .* must be an integer"):
        SmallState.loads(encoded(v="2"))
    with pytest.raises(ProtocolError, match="small state: expected an object, got list"):
        SmallState.loads("[1, 2]")
    with pytest.raises(ProtocolError, match="small state: not a valid encoding"):
        SmallState.loads('{"__dict__": {"x": {"__what__": 1}}}')


def previous_small(rank: int) -> str:
    with open(PREVIOUS / f"rank_{rank:05d}.safetensors", "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(size))["__metadata__"]["small"]


def test_a_header_written_before_the_record_had_a_version_still_decodes():
    """The previous release's files (no "v", none of the fields added since): version 1, the defaults."""
    text = previous_small(0)
    assert "v" not in json.loads(text)["__dict__"]
    state = SmallState.loads(text)
    assert (state.iteration, state.consumed_train_samples, state.checkpoint_version) == (8, 64, 3.0)
    assert isinstance(state.optimizer, list) and isinstance(state.rng["random"], tuple)
    assert (state.frozen, state.extra_state, state.rerun_state_machine, state.args, state.grad_scaler) == (None,) * 5
    # version 1 may lack only the fields added after it
    old = json.loads(text)
    del old["__dict__"]["rng"]
    with pytest.raises(ProtocolError, match="field 'rng' is missing"):
        SmallState.loads(json.dumps(old))


def test_captured_encodes_once_when_first_asked_not_when_taken():
    unencodable = full_state(args={"x": object()})
    captured = Captured(unencodable)  # (the training thread: no encoding here)
    with pytest.raises(TypeError, match="cannot store a object"):
        _ = captured.text
    state = full_state()
    captured = Captured(state)
    assert captured.text == state.dumps() and captured.text is captured.text

"""JSON encoding of the small state's values (optimizer param_groups, scheduler, RNG states) without
pickle; the record they travel in is ``small_state_record.SmallState``.

Tensors, tuples and numpy arrays are tagged so a round trip restores their
types exactly; anything else unexpected is an error at save time rather than
a surprise at load time.
"""

from __future__ import annotations

import base64
import json

import numpy
import torch

from megatron_pec.format.stformat import dtype_code, torch_dtype


def _encode(obj):
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return {"__float__": repr(obj)}  # repr keeps inf/nan and every bit
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        # (flattened first: a 0-dim tensor, a loss or a grad scale, has no dimension to view as bytes)
        return {"__tensor__": dtype_code(t.dtype), "shape": list(t.shape),
                "b64": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                .decode()}
    if isinstance(obj, numpy.ndarray):
        return {"__ndarray__": obj.dtype.str, "shape": list(obj.shape),
                "b64": base64.b64encode(numpy.ascontiguousarray(obj).tobytes()).decode()}
    if isinstance(obj, numpy.generic):
        return _encode(obj.item())
    if isinstance(obj, (tuple, list)):
        # Fast path for the 625 ints of Python's RNG state, encoded at every save.
        values = list(obj) if _all_ints(obj) else [_encode(v) for v in obj]
        return {"__tuple__": values} if isinstance(obj, tuple) else values
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: _encode(v) for k, v in obj.items()}}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    raise TypeError(f"megatron-pec cannot store a {type(obj).__name__} in checkpoint metadata")


def _decode(obj):
    if isinstance(obj, list):
        # Fast path for the 625 ints of Python's RNG state, decoded at every restore.
        return obj if _all_ints(obj) else [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tensor__" in obj:
        dtype = torch_dtype(obj["__tensor__"])
        raw = bytearray(base64.b64decode(obj["b64"]))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(obj["shape"]).clone()
    if "__ndarray__" in obj:
        return numpy.frombuffer(base64.b64decode(obj["b64"]), dtype=numpy.dtype(obj["__ndarray__"])) \
            .reshape(obj["shape"]).copy()
    if "__tuple__" in obj:  # (the same fast path: the tuple of Python's RNG state)
        return tuple(_decode(obj["__tuple__"]))
    if "__dict__" in obj:
        return {k: _decode(v) for k, v in obj["__dict__"].items()}
    if "__items__" in obj:
        return {_decode(k): _decode(v) for k, v in obj["__items__"]}
    raise ValueError(f"unknown tagged value in checkpoint metadata: {sorted(obj)}")


def _all_ints(values) -> bool:
    """Every value a plain int (not a bool), tested at C speed: 625 of them at every save and restore."""
    return set(map(type, values)) <= _INT


_INT = {int}


def dumps(obj) -> str:
    return json.dumps(_encode(obj), separators=(",", ":"))


def loads(text: str):
    return _decode(json.loads(text))

"""``python -m megatron_pec export``: a committed iteration's model weights as consolidated safetensors.

Reads storage only (no process group, no GPU, no Megatron). The manifest names each
expert's version and the rank file holding it; the rank layouts (``RankLayout``) say
where each stored slice lies in the global parameters. Every item that is read is
first checked against the manifest's checksum (streamed, a bounded buffer at a time);
then each global tensor is assembled from its slices and written, one at a time, so
memory stays at the largest tensor. Exported are the optimizer's main parameters
(fp32 under mixed precision: the model's bf16/fp16 weights are their rounding) and the
model's persistent buffers, under the names a model without model parallelism has.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch

from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import Manifest, RankLayout, SlotHeader
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.format.stformat import ITEMSIZE, dtype_code
from megatron_pec.restore.committed_files import CommittedFiles
from megatron_pec.store.checkpoint_dir import CheckpointDir, ManifestError
from megatron_pec.store.storage import Storage

SIDECAR = "pec_export.json"


class ExportError(RuntimeError):
    """Why the iteration cannot be exported (the message says what to do)."""


@dataclass
class GlobalTensor:
    name: str
    shape: list[int]
    dtype: str
    pieces: list[tuple[int, int, str, int]] = field(default_factory=list)  # (begin, end, path, file offset)
    raw: bytes | None = None  # a buffer's bytes (from the small state)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def export(directory: CheckpointDir, out_dir: str, iteration: int | None = None, max_shard_bytes: int = 5 << 30,
           progress=None, out_storage: Storage | None = None) -> dict:
    """Write iteration ``iteration`` (default: the newest committed) of ``directory`` to ``out_dir``;
    returns the summary also written to ``out_dir/pec_export.json``. ``progress(done_bytes, total_bytes)``.
    Reads through ``directory.storage``, writes through ``out_storage`` (``out_dir`` is a path or prefix on
    it; default the same storage: e.g. an object store's checkpoint exported to a local directory)."""
    storage = directory.storage
    target = out_storage or storage
    m = _manifest(directory, iteration)
    layouts = _layouts(directory, m)
    files = CommittedFiles(directory, m, ExportError)
    tensors = _tensors(layouts, files)
    small = _small_states(files, layouts)
    _add_buffers(tensors, layouts, small)
    shards = _shards(sorted(tensors.values(), key=lambda t: t.name), max_shard_bytes)
    _prepare(out_dir, [name for name, _ in shards], target)
    total = sum(t.nbytes for t in tensors.values())
    files.verify()  # every item read is verified before any byte is exported
    done = 0
    for file_name, entries in shards:
        done = _write_shard(os.path.join(out_dir, file_name), entries, storage, target, done, total, progress)
    pec = json.loads(next(iter(small.values())).pec) if small else {}
    summary = {
        "source": directory.root, "iteration": m.iteration, "fingerprint": m.fingerprint, "topology": m.topology,
        "world_size": m.world_size, "expert_versions": m.experts,
        "experts_older_than_iteration": sum(1 for v in m.experts.values() if v < m.iteration),
        "plt": pec.get("plt"), "lost_tokens": pec.get("lost_tokens"), "recoveries": pec.get("recoveries"),
        "tensors": len(tensors), "bytes": total, "files": [name for name, _ in shards],
        "weights": "main parameters as the optimizer holds them (fp32 under mixed precision) and persistent buffers",
    }
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: name for name, entries in shards for t in entries}}
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index, target)
    _write_json(os.path.join(out_dir, SIDECAR), summary, target)
    return summary


# ---- what to read ----------------------------------------------------------------------------------
def _manifest(directory: CheckpointDir, iteration: int | None) -> Manifest:
    committed = directory.committed_iterations()
    if not committed:
        raise ExportError(f"no committed megatron-pec checkpoint under {directory.root}")
    if iteration is None:
        iteration = committed[0]
    elif iteration not in committed:
        raise ExportError(f"iteration {iteration} is not committed under {directory.root}; committed: "
                          f"{', '.join(map(str, sorted(committed)))}")
    try:
        return directory.read_manifest(iteration)
    except ManifestError as exc:
        raise ExportError(str(exc)) from None


def _layouts(directory: CheckpointDir, m: Manifest) -> dict[int, RankLayout]:
    layouts = {}
    for rank in sorted(map(int, m.ranks)):
        try:
            layouts[rank] = directory.read_rank_layout(m.fingerprint, rank)
        except ManifestError as exc:
            raise ExportError(
                f"iteration {m.iteration} has no readable layout record ({exc}); checkpoints written before "
                "megatron-pec recorded layouts cannot be exported: restore one with this megatron-pec and save "
                "again") from None
        if layouts[rank].not_global:
            raise ExportError(f"cannot export iteration {m.iteration}: {layouts[rank].not_global}")
    return layouts


def _tensors(layouts: dict[int, RankLayout], files: CommittedFiles) -> dict[str, GlobalTensor]:
    tensors: dict[str, GlobalTensor] = {}
    for rank, layout in layouts.items():
        for name, (index, begin, end) in layout.slices.items():
            if not name.endswith(".param"):
                continue  # optimizer state
            param = layout.params[index]
            tensor = tensors.setdefault(param.name, GlobalTensor(param.name, param.shape, param.dtype))
            if (tensor.shape, tensor.dtype) != (param.shape, param.dtype):
                raise ExportError(f"{param.name}: rank {rank} records shape {param.shape} {param.dtype}, another "
                                  f"rank {tensor.shape} {tensor.dtype}")
            file = files.holding(name.split("/", 1)[0], rank)
            stored = file.by_name.get(name)
            if stored is None:
                raise ExportError(f"{file.path} lacks tensor {name}, which its layout record names")
            tensor.pieces.append((begin, end, file.path, file.header.data_start + stored.begin))
    for tensor in tensors.values():
        _check_coverage(tensor)
    return tensors


def _check_coverage(tensor: GlobalTensor) -> None:
    numel, position = math.prod(tensor.shape), 0
    tensor.pieces.sort()
    for begin, end, path, _ in tensor.pieces:
        if begin != position:
            what = "overlaps" if begin < position else f"leaves elements {position}..{begin} unsaved before"
            raise ExportError(f"{tensor.name}: the slice from {path} {what} (elements {begin}..{end})")
        position = end
    if position != numel:
        raise ExportError(f"{tensor.name}: the saved slices cover {position} of its {numel} elements")


def _small_states(files: CommittedFiles, layouts: dict[int, RankLayout]) -> dict[int, SlotHeader]:
    """Each rank's header at the iteration (small state: buffers; PEC state: PLT)."""
    for rank in layouts:
        files.holding(NON_EXPERT, rank)
    return dict(sorted(files.headers(files.m.iteration).items()))


def _add_buffers(tensors: dict[str, GlobalTensor], layouts: dict[int, RankLayout],
                 small: dict[int, SlotHeader]) -> None:
    """Persistent buffers (the router's expert bias, ...) and frozen parameters (kept under their global
    names, ``<chunk>/<name>``) from the first rank that holds each."""
    for rank, header in small.items():
        names = layouts[rank].buffers
        state = SmallState.loads(header.small)
        kept = [(names.get(key), value) for key, value in (state.buffers or {}).items()]
        kept += [(key.split("/", 1)[1], value) for key, value in (state.frozen or {}).items()]
        for name, value in kept:
            if name is not None and name not in tensors:
                raw = value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                tensors[name] = GlobalTensor(name, list(value.shape), dtype_code(value.dtype), raw=raw)


# ---- verify and write ------------------------------------------------------------------------------
def _shards(tensors: list[GlobalTensor], max_bytes: int) -> list[tuple[str, list[GlobalTensor]]]:
    groups: list[list[GlobalTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


def _prepare(out_dir: str, names: list[str], storage: Storage) -> None:
    taken = [n for n in names + ["model.safetensors.index.json", SIDECAR] if storage.exists(os.path.join(out_dir, n))]
    if taken:
        raise ExportError(f"{out_dir} already holds {', '.join(taken)}; export into an empty directory (nothing "
                          "was overwritten)")


def _write_shard(path: str, tensors: list[GlobalTensor], storage: Storage, target: Storage, done: int, total: int,
                 progress) -> int:
    """The shard ``path`` on ``target``, its tensors assembled from the rank files on ``storage``."""
    body, offset = {}, 0
    for t in tensors:
        body[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body["__metadata__"] = {"format": "pt"}
    head = json.dumps(body, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def chunks():  # streamed: one tensor assembled at a time
        nonlocal done
        yield len(head).to_bytes(8, "little") + head
        for t in tensors:
            yield _assemble(t, storage)
            done += t.nbytes
            if progress is not None:
                progress(done, total)

    target.write(path, chunks())
    return done


def _assemble(tensor: GlobalTensor, storage: Storage) -> bytes | bytearray:
    if tensor.raw is not None:
        if len(tensor.raw) != tensor.nbytes:
            raise ExportError(f"buffer {tensor.name} holds {len(tensor.raw)} bytes for shape {tensor.shape}")
        return tensor.raw
    size = ITEMSIZE[tensor.dtype]
    out = bytearray(tensor.nbytes)
    view = memoryview(out)
    for begin, end, path, offset in tensor.pieces:
        try:
            view[begin * size:end * size] = storage.read_range(path, offset, (end - begin) * size)
        except OSError as exc:
            raise ExportError(f"{path} is unreadable while reading {tensor.name}: {exc.strerror or exc}") from None
    return out


def _write_json(path: str, data: dict, storage: Storage) -> None:
    storage.write(path, [json.dumps(data, indent=1, sort_keys=True).encode()])


def progress_bar(stream=sys.stderr):
    """A progress callback drawing a bar on a terminal (nothing when ``stream`` is not one)."""
    if not stream.isatty():
        return None

    def draw(done: int, total: int) -> None:
        share = done / total if total else 1.0
        bar = "#" * int(share * 40)
        stream.write(f"\rexporting [{bar:<40}] {share:6.1%}  {done / 2**20:,.0f}/{total / 2**20:,.0f} MiB")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return draw

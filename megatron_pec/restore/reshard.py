"""Restore a persisted iteration onto another data-parallel layout (storage only).

Used when the newest committed iteration was saved by another configuration. Each
rank reads, from whichever old rank files hold them, the global element ranges its
own slices now cover: the rank layouts (``RankLayout``) of both sides place every
byte by global parameter name, kind and flat range. Every old item touched is first
checked against the manifest's checksum (streamed, a bounded buffer at a time); then
only the overlapping ranges are read. No gather to one rank, no collective beyond
the loader's agreement. The PEC state (expert versions, token counts, K) is merged
from every old rank's header, so it carries over.

Supported: a different data-parallel size (world size) with the same tensor,
pipeline, context and expert parallel sizes; anything else is refused with a message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_pec.format.item_names import NON_EXPERT, ExpertId, parse_item
from megatron_pec.format.protocol import Manifest, RankLayout, SlotHeader
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.format.stformat import ITEMSIZE, torch_dtype
from megatron_pec.pec import lost_tokens
from megatron_pec.pec.state import PecState
from megatron_pec.restore.committed_files import CommittedFile, CommittedFiles
from megatron_pec.store.checkpoint_dir import CheckpointDir, ManifestError

KEEP_SAME = ("tp", "pp", "cp")  # parallel sizes a resharding restore cannot change yet


class ReshardError(RuntimeError):
    """Why the checkpoint cannot be restored onto this layout (the message says what to do)."""


def change(old: dict, new: dict) -> str:
    """``world 4 → 2, EP 2 → 2, DP 2 → 1``."""
    return ", ".join(f"{label} {old.get(key)} → {new.get(key)}"
                     for label, key in (("world", "world_size"), ("EP", "ep"), ("DP", "dp")))


def refusal(old: dict, new: dict) -> str | None:
    """Why a checkpoint of topology ``old`` cannot be resharded onto ``new`` (None: it can)."""
    differing = [f"{k} {old.get(k)} -> {new.get(k)}" for k in KEEP_SAME if old.get(k) != new.get(k)]
    if differing:
        return (f"megatron-pec restores onto other data- and expert-parallel sizes only; this checkpoint also "
                f"differs in "
                f"{', '.join(differing)}. Restart with the saved {', '.join(k.upper() for k in KEEP_SAME)} sizes")
    return None


@dataclass
class Resharded:
    """What one rank restores from a checkpoint of another layout."""

    tensors: dict                       # slice name -> tensor
    small: SmallState
    pec: PecState | None
    tokens_at_target: dict[ExpertId, int]
    versions: dict[str, int]
    report: lost_tokens.PltReport | None


class Resharder:
    def __init__(self, directory: CheckpointDir, m: Manifest, mine: RankLayout, rank: int, stage: set[ExpertId]):
        self.m, self.mine, self.rank, self.stage, self.storage = m, mine, rank, stage, directory.storage
        self.old = {}
        for r in sorted(map(int, m.ranks)):
            try:
                self.old[r] = directory.read_rank_layout(m.fingerprint, r)
            except ManifestError as exc:
                raise ReshardError(
                    f"iteration {m.iteration} was saved with another parallel layout and has no readable layout "
                    f"record ({exc}); checkpoints written before megatron-pec recorded layouts restore only onto "
                    "the layout that wrote them") from None
        self.files = CommittedFiles(directory, m, ReshardError)

    def restore(self) -> Resharded:
        pieces = self._pieces()
        self.files.verify()
        tensors = {name: self._assemble(dtype, spans, self.mine.slices[name])
                   for name, (dtype, spans) in pieces.items()}
        headers = self.files.headers(self.m.iteration)
        small = self._small(headers)
        pec, report, at_target = self._account(headers)
        versions = {item: (self.m.iteration if item == NON_EXPERT else self.m.experts[item])
                    for item in {name.split("/", 1)[0] for name in self.mine.slices}}
        return Resharded(tensors, small, pec, at_target, versions, report)

    def _small(self, headers: dict[int, SlotHeader]) -> SmallState:
        """One old rank's small state, with the frozen parameters and modules' extra states of every old
        rank of this rank's tensor-parallel position (keyed by global names: an expert's comes from the rank
        that held it) and no rerun state (Megatron ignores it when the sharding changed)."""
        ranks = sorted(headers)
        mine = ranks[self.rank % len(ranks)]
        small = SmallState.loads(headers[mine].small)
        tp = max(1, int(self.m.topology.get("tp") or 1))
        merged = {"frozen": small.frozen, "extra_state": small.extra_state}
        for r in [r for r in ranks if r != mine and r % tp == self.rank % tp]:
            other = SmallState.loads(headers[r].small)
            for kind in ("frozen", "extra_state"):
                theirs = getattr(other, kind)
                if theirs is not None:
                    merged[kind] = {**theirs, **(merged[kind] or {})}
        small = dataclasses.replace(small, **merged, rerun_state_machine=None)
        if self.m.topology.get("ep") != self.mine.topology.get("ep"):
            # A module holding all local experts (TE's GroupedLinear) keeps one extra state for them all:
            # another expert-parallel size gives it other experts (Megatron splits it per expert).
            grouped = sorted(k for k in small.extra_state or {}
                             if ".experts." in k and ".local_experts." not in k)
            if grouped:
                raise ReshardError(f"the extra state of {grouped[0]} (and {len(grouped) - 1} more) covers all of a "
                                   "rank's experts (grouped experts): megatron-pec cannot split it for another "
                                   "expert-parallel size; restart with the saved EP size "
                                   f"{self.m.topology.get('ep')}")
        return small

    # ---- where each byte comes from --------------------------------------------------------------
    def _pieces(self) -> dict[str, tuple[str, list[tuple[int, int, CommittedFile, int]]]]:
        """New slice -> (stored dtype, [(begin, end) elements of it, old file, file offset])."""
        index: dict[tuple[str, str], list] = {}
        for r, layout in self.old.items():
            for name, (p, begin, end) in layout.slices.items():
                index.setdefault((layout.params[p].name, _kind(name)), []).append((begin, end, r, name))
        out = {}
        for name, (p, lo, hi) in self.mine.slices.items():
            param = self.mine.params[p]
            spans, covered, dtypes = [], 0, set()
            for begin, end, r, old_name in index.get((param.name, _kind(name)), ()):
                a, b = max(lo, begin), min(hi, end)
                if a >= b:
                    continue
                file = self.files.holding(old_name.split("/", 1)[0], r)
                entry = file.by_name.get(old_name)
                if entry is None:
                    raise ReshardError(f"{file.path} lacks {old_name}, which its layout record names")
                dtypes.add(entry.dtype)
                size = ITEMSIZE[entry.dtype]
                spans.append((a - lo, b - lo, file, file.header.data_start + entry.begin + (a - begin) * size))
                covered += b - a
            if covered != hi - lo or len(dtypes) > 1:
                raise ReshardError(f"{param.name} ({_kind(name)}): the checkpoint holds {covered} of the {hi - lo} "
                                   f"elements [{lo}, {hi}) rank {self.rank} owns now"
                                   + (f", in differing dtypes {sorted(dtypes)}" if len(dtypes) > 1 else ""))
            out[name] = (dtypes.pop() if dtypes else self.mine.params[p].dtype, spans)
        return out

    def _assemble(self, dtype: str, spans, where: list[int]):
        import torch

        _, lo, hi = where
        out = torch.empty(hi - lo, dtype=torch_dtype(dtype))
        raw = memoryview(out.view(torch.uint8).numpy())
        size = out.element_size()
        for a, b, file, offset in spans:
            raw[a * size:b * size] = self.storage.read_range(file.path, offset, (b - a) * size)
        return out

    # ---- PEC state ---------------------------------------------------------------------------------
    def _account(self, headers: dict[int, SlotHeader]):
        """The PEC state merged from every old rank's part, this restore's PLT folded in."""
        if not self.stage:
            return None, None, {}
        state = PecState.loads(headers[min(headers)].pec)
        at_target: dict[ExpertId, int] = {}
        for h in headers.values():
            part = PecState.loads(h.pec)
            for mine, theirs in ((state.snapshot, part.snapshot), (state.persist, part.persist)):
                mine.saved_at.update(theirs.saved_at)
                mine.tokens_at.update(theirs.tokens_at)
            at_target.update({parse_item(k): v for k, v in h.tokens.items()})
        version_of = {x: self.m.experts[str(x)] for x in at_target if str(x) in self.m.experts}
        at_version = {}
        for version in set(version_of.values()):
            tokens = at_target if version == self.m.iteration else {
                parse_item(k): v for h in self.files.headers(version).values() for k, v in h.tokens.items()}
            at_version.update({x: tokens[x] for x, v in version_of.items() if v == version})
        report = lost_tokens.lost_tokens(at_target, at_version, version_of, self.m.iteration)
        state.recovered(report, version_of, at_version, self.stage)
        return state, report, {x: at_target[x] for x in self.stage if x in at_target}


def _kind(slice_name: str) -> str:
    return slice_name.rsplit(".", 1)[-1]


__all__ = ["Resharder", "Resharded", "ReshardError", "change", "refusal"]

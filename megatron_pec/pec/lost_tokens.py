"""Lost-token accounting (PLT, "portion of lost tokens", PEC §4) — pure.

Run by every rank at restore (load step 5, decide: after the sources are chosen) and by the
``inspect`` tool. A partial checkpoint restores some experts from versions
older than the target iteration; the work those experts did since is lost:

    PLT(expert) = cumulative tokens at the target - cumulative tokens at its version

Cumulative per-expert token counts are recorded with every checkpoint, so this
is exact. Dynamic-K (:func:`next_k`) doubles K when the accumulated PLT passes a
threshold, which keeps model quality intact (PEC: final PLT < 3.75%).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from megatron_pec.format.item_names import ExpertId

LISTED_PER_LAYER = 16  # stale experts named per layer in the log; beyond, the count and the costliest

__all__ = ["PltReport", "lost_tokens", "accumulate", "next_k"]


@dataclass(frozen=True, slots=True)
class PltReport:
    """Tokens lost by one restore, overall, per layer and per stale expert."""

    lost_tokens: int
    total_tokens: int  # expert-token assignments (tokens x top-k) of all experts up to the target
    per_layer: Mapping[int, tuple[int, int]]  # layer -> (lost, total)
    stale_experts: Mapping[ExpertId, tuple[int, int]]  # expert -> (restored version, lost) if version < target

    @property
    def fraction(self) -> float:
        return self.lost_tokens / self.total_tokens if self.total_tokens else 0.0

    def per_layer_fraction(self, layer: int) -> float:
        if layer not in self.per_layer:
            raise KeyError(f"no MoE layer {layer} in this PLT report (layers: {sorted(self.per_layer)})")
        lost, total = self.per_layer[layer]
        return lost / total if total else 0.0

    def format_lines(self) -> list[str]:
        """One summary line, then one line per layer that has stale experts.

        Layers restored entirely at the target are left out so that a big model
        with a fresh restore logs a single line.
        """
        stale_layers = sorted({e.layer for e in self.stale_experts})
        lines = [f"PLT {100 * self.fraction:.4f}% ({self.lost_tokens} of {self.total_tokens} expert-tokens lost; "
                 f"{len(self.stale_experts)} stale experts in {len(stale_layers)} of {len(self.per_layer)} MoE layers)"]
        by_layer: dict[int, list] = {layer: [] for layer in stale_layers}
        for e, (version, n) in sorted(self.stale_experts.items()):
            by_layer[e.layer].append((e, version, n))
        for layer in stale_layers:
            lost, total = self.per_layer[layer]
            stale = by_layer[layer]
            listed = stale if len(stale) <= LISTED_PER_LAYER else \
                sorted(stale, key=lambda s: -s[2])[:LISTED_PER_LAYER]  # (256 experts a layer: the costliest)
            experts = ", ".join(f"E{e.expert}@{version} (-{n})" for e, version, n in listed)
            if len(listed) < len(stale):
                experts = f"{len(stale)}, the {len(listed)} that lost most: {experts}"
            lines.append(f"  layer {layer}: PLT {100 * self.per_layer_fraction(layer):.4f}% "
                         f"({lost}/{total}); stale expert@version (-lost tokens): {experts}")
        return lines


def lost_tokens(cumulative_at_target: Mapping[ExpertId, int], cumulative_at_version: Mapping[ExpertId, int],
                version_of: Mapping[ExpertId, int], target_iteration: int) -> PltReport:
    """PLT of restoring every expert from ``version_of[expert]`` when the target is ``target_iteration``.

    ``cumulative_at_target[e]`` / ``cumulative_at_version[e]``: tokens expert ``e``
    had processed since training start, as recorded at the target and at its
    restored version. All three mappings must cover the same experts. Raises
    ``ValueError`` on missing experts, versions after the target, negative
    counts, or counts that go down (all mean inconsistent bookkeeping).
    """
    experts = set(cumulative_at_target)
    for name, other in (("cumulative_at_version", cumulative_at_version), ("version_of", version_of)):
        if set(other) != experts:
            missing, extra = sorted(experts - set(other)), sorted(set(other) - experts)
            raise ValueError(f"PLT bookkeeping is inconsistent: {name} lacks {_names(missing)} "
                             f"and has extra {_names(extra)} compared with cumulative_at_target")
    per_layer: dict[int, list[int]] = {}
    stale: dict[ExpertId, tuple[int, int]] = {}
    for e in sorted(experts):
        at_target, at_version, version = cumulative_at_target[e], cumulative_at_version[e], version_of[e]
        if version > target_iteration:
            raise ValueError(f"PLT: expert {e} restored from iteration {version}, after the target {target_iteration}")
        if at_target < 0 or at_version < 0:
            raise ValueError(f"PLT: negative cumulative token count for expert {e} ({at_version}, {at_target})")
        lost = at_target - at_version
        if lost < 0:
            raise ValueError(f"PLT: expert {e} has {at_target} cumulative tokens at target {target_iteration} but "
                             f"{at_version} at its version {version}; counts cannot go down")
        if version == target_iteration and lost:
            raise ValueError(f"PLT: expert {e} is restored at the target {target_iteration} yet its counts differ "
                             f"({at_version} vs {at_target})")
        layer = per_layer.setdefault(e.layer, [0, 0])
        layer[0] += lost
        layer[1] += at_target
        if version < target_iteration:
            stale[e] = (version, lost)
    return PltReport(
        lost_tokens=sum(lost for lost, _ in per_layer.values()),
        total_tokens=sum(total for _, total in per_layer.values()),
        per_layer={layer: (lost, total) for layer, (lost, total) in sorted(per_layer.items())},
        stale_experts=stale,
    )


def accumulate(previous_lost: int, report: PltReport) -> tuple[int, float]:
    """Running lost tokens over all faults so far, and that as a fraction of
    ``report.total_tokens`` (all expert-token work up to this restore's target)."""
    if previous_lost < 0:
        raise ValueError(f"previous_lost must be >= 0, got {previous_lost}")
    lost = previous_lost + report.lost_tokens
    return lost, (lost / report.total_tokens if report.total_tokens else 0.0)


def next_k(k: int, accumulated_plt: float, threshold: float, num_experts: int) -> int:
    """Dynamic-K (PEC): double K, capped at ``num_experts``, once the accumulated
    PLT exceeds ``threshold``; otherwise keep K."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in 1..num_experts ({num_experts}), got {k}")
    if accumulated_plt < 0 or threshold < 0:
        raise ValueError(f"accumulated_plt ({accumulated_plt}) and threshold ({threshold}) must be >= 0")
    return min(2 * k, num_experts) if accumulated_plt > threshold else k


def _names(experts: list[ExpertId]) -> str:
    shown = ", ".join(str(e) for e in experts[:5])
    return f"[{shown}{', ...' if len(experts) > 5 else ''}]" if experts else "nothing"

"""A restore's lost work (PLT) and the K it continues with (load step 5, decide: ``restore/loader.py``'s).

Each rank knows, for the experts it holds, the version it restores them from and their token counts there;
``accounting_columns`` lays that out as one int per expert of the model per column (-1: unknown here) so
that one MAX all-reduce (the plan's vote) completes it on every rank. ``account`` then folds the lost
tokens of the whole model into the dense source's PEC state, identically on every rank, and ``choose_k``
applies Dynamic-K (or the flags' K).
"""

from __future__ import annotations

from megatron_pec.common import log
from megatron_pec.format.item_names import NON_EXPERT, ExpertId, item_name
from megatron_pec.pec import lost_tokens
from megatron_pec.pec.state import PecState, flag_k

ACCOUNT_VECTORS = 7  # per expert: restored version, tokens there, tokens at the target, 2 levels x 2


def accounting_columns(plan: dict, state: PecState, names: list[str]) -> list[list[int]]:
    """This rank's part of the PLT accounting, one int per expert of the model (``names``) in each of
    ``ACCOUNT_VECTORS`` columns (-1: unknown here): the version each expert is restored from, its tokens at
    that version, at the dense source's iteration, and both PEC levels' versions and tokens. Each rank's
    file knows the experts it holds; the MAX over ranks completes them. ``plan``: item -> its source."""
    dense = plan[NON_EXPERT]
    known = [{item_name(x): v for x, v in level.items()} for level in _levels(state)]
    version, at_version = {}, {}
    for name in names:
        source = plan.get(name)
        if source is not None:
            version[name] = source.items[name]
            at_version[name] = source.tokens_at_version(name)
    return [[values.get(name, -1) for name in names]
            for values in (version, at_version, dense.header.tokens, *known)]


def account(ctx, target: int, state: PecState | None,
            accounted: list[list[int]]) -> tuple[PecState | None, lost_tokens.PltReport | None, dict[ExpertId, int]]:
    """PLT of this restore over every expert of the model (identical on every rank), folded into the dense
    source's PEC ``state`` (None without MoE); and the cumulative token counts at ``target`` of this stage's
    experts. ``accounted``: the columns of ``accounting_columns``, completed over all ranks; ``ctx``: the
    loader's ``LoadContext``."""
    if state is None:
        return None, None, {}
    columns = [dict(zip(ctx.all_experts, column)) for column in accounted]
    version_of, tokens_at_version, tokens_at_target = columns[:3]
    stage = stage_experts(ctx)
    for level, column in zip(_levels(state), columns[3:]):
        level.update({x: v for x, v in column.items() if v >= 0 and x in stage})
    report = lost_tokens.lost_tokens(tokens_at_target, tokens_at_version, version_of, target)
    state.recovered(report, version_of, tokens_at_version, stage)
    choose_k(ctx.config, ctx.num_experts, state)
    return state, report, {x: tokens_at_target[x] for x in stage}


def stage_experts(ctx) -> set[ExpertId]:
    """Every expert of the MoE layers this pipeline stage holds (all ranks of the stage, not just this one)."""
    layers = {x.layer for x in ctx.experts_held}
    return {x for x in ctx.all_experts if x.layer in layers}


def choose_k(config, num_experts: int, state: PecState) -> None:
    """K from here on, decided here only: Dynamic-K raises it when the accumulated PLT passed the threshold;
    without Dynamic-K the flags win over the restored K."""
    if not num_experts:
        return
    if not config.dynamic_k:
        state.set_k(*flag_k(config.snapshot_k, config.persist_k, num_experts))
        return
    k = lost_tokens.next_k(state.snapshot.k, state.plt, config.plt_threshold, num_experts)
    if k != state.snapshot.k:
        persist_k = min(k, 2 * state.persist.k)
        log.info(f"accumulated PLT {state.plt:.2%} exceeds {config.plt_threshold:.2%}: Dynamic-K raises snapshot "
                 f"K {state.snapshot.k} -> {k}, persist K {state.persist.k} -> {persist_k}", rank0=True)
        state.set_k(k, persist_k)


def _levels(state: PecState) -> tuple[dict, dict, dict, dict]:
    """The PEC state's per-expert dicts, in the order of the accounting's last four columns."""
    return state.snapshot.saved_at, state.snapshot.tokens_at, state.persist.saved_at, state.persist.tokens_at


__all__ = ["ACCOUNT_VECTORS", "account", "accounting_columns", "choose_k", "stage_experts"]

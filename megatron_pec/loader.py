"""Phases 7-9 of a load: agree on the iteration, pick sources, restore, account PLT.

Runs on every rank (collective). Communication is limited to a few small
all-gathers/all-reduces on CPU tensors plus the DDP parameter all-gather:
every rank reads its own shard back, no scatter.

7. agree    the newest iteration every rank can restore (memory or storage); if a
            rank then finds its copy corrupt, all ranks drop it and try the next.
8. source   non-expert state from the agreed iteration T; each expert from the newest
            version <= T that every rank holding a shard of it can read.
9. restore  optimizer shards, model params, RNG, scheduler, args; PLT logged.
"""

from __future__ import annotations

import os
import sys

import torch

from megatron_pec import plt, smallstate
from megatron_pec.errors import CheckpointError
from megatron_pec.items import NON_EXPERT, item_name
from megatron_pec.megatron import collect, restore
from megatron_pec.pec_state import PecState, cumulative_from_json
from megatron_pec.sources import (Source, SourceError, expert_source_for, memory_sources, storage_sources)
from megatron_pec.storage import PosixStorage

MAX_CANDIDATES = 32
NONE = 2**62  # "no version" in MIN reductions


def say(message: str) -> None:
    print(message, file=sys.stderr if message.startswith("megatron-pec: WARNING") else sys.stdout, flush=True)


class Loader:
    def __init__(self, engine, root: str):
        self.e, self.root = engine, os.path.abspath(root)
        self.storage = PosixStorage()
        self.rank = engine.rank

    # ---- 7. agree ------------------------------------------------------------------------------
    def load(self, model, optimizer, scheduler) -> tuple[int, float]:
        e = self.e
        error, memory, stored, manifests = None, [], {}, {}
        try:
            e.agent_flush()
            memory = memory_sources(e.node_dir, self.rank, e.config.job_id, e.fingerprint, self.root)
            stored, manifests = storage_sources(self.root, self.rank, e.fingerprint, e.topology, self.storage)
        except SourceError as exc:
            error = f"megatron-pec: {exc}"
        e.raise_if_any_rank(error)
        self._warn_stale_tracker(manifests)
        excluded: set[int] = set()
        while True:
            target = self._agree({s.iteration for s in memory} | set(stored), excluded)
            if target is None:
                if excluded:
                    raise CheckpointError(f"megatron-pec: no valid checkpoint left under {self.root} after "
                                          f"rejecting iterations {sorted(excluded)}; see the messages above")
                if self.rank == 0:
                    say(f"megatron-pec: no checkpoint found under {self.root}; training from scratch")
                return 0, 0
            plan, error = self._plan(target, memory, stored, manifests)
            if not self.e.everyone(error is None):
                say(f"megatron-pec: WARNING rank {self.rank}: cannot restore iteration {target}: "
                    f"{error or 'another rank cannot'}; falling back to an older checkpoint")
                excluded.add(target)
                continue
            self._retire_newer(target)
            return self._restore(target, plan, model, optimizer, scheduler)

    def _retire_newer(self, target: int) -> None:
        """Rank 0: de-commit what an abandoned run left after ``target`` in the --save directory
        (see ``manifest.retire_after``). Every later save needs rank 0, so this precedes them all."""
        config = self.e.config
        if self.rank != 0 or config.finetune or not config.save or os.path.abspath(config.save) != self.root:
            return
        from megatron_pec.manifest import retire_after

        try:
            retired = retire_after(self.root, target, self.storage)
        except OSError as exc:
            say(f"megatron-pec: WARNING cannot retire the iterations after {target} under {self.root} ({exc}); "
                "until they are saved again their old manifests or node markers remain")
            return
        if retired:
            say(f"megatron-pec: iterations {retired} under {self.root} belong to an abandoned run after the "
                f"restored iteration {target}; removed their manifests and node markers (training saves them again)")

    def _warn_stale_tracker(self, manifests: dict) -> None:
        """The tracker is a hint for Megatron's tools; validity comes only from manifests."""
        from megatron_pec.manifest import TRACKER, read_tracker

        tracker = read_tracker(self.root, self.storage)
        if self.rank == 0 and tracker and tracker.isdigit() and int(tracker) not in manifests:
            say(f"megatron-pec: WARNING {self.root}/{TRACKER} names iteration {tracker}, which has no valid "
                f"manifest; ignoring it and using the newest committed iteration")

    def _agree(self, mine: set[int], excluded: set[int]) -> int | None:
        mine = sorted((i for i in mine if i not in excluded), reverse=True)[:MAX_CANDIDATES]
        t = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
        t[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        gathered = [torch.empty_like(t) for _ in range(self.e.world_size)]
        torch.distributed.all_gather(gathered, t, group=self.e.cpu_group)
        common = set.intersection(*({int(x) for x in g if x >= 0} for g in gathered))
        return max(common) if common else None

    # ---- 8. source -----------------------------------------------------------------------------
    def _plan(self, target: int, memory: list[Source], stored: dict[int, Source], manifests: dict):
        """Sources for T's non-expert state and each held expert's version, agreed across ranks."""
        dense, error = self._dense_source(target, memory, stored)
        persisted = max((i for i in manifests if i <= target), default=None)
        manifest_t = manifests.get(persisted)
        held = [item_name(x) for x in self.e.experts_held]
        best = {}
        for item in held:
            versions = [s.items[item] for s in memory if item in s.items and s.iteration <= target]
            if manifest_t is not None and item in manifest_t["experts"]:
                versions.append(manifest_t["experts"][item])
            best[item] = max(versions, default=None)
        agreed = self._agree_versions(best)
        plan = {NON_EXPERT: dense}
        fallback = {}
        for item in held:
            source = expert_source_for(item, agreed[item], memory, stored, self.root, self.rank, manifest_t) \
                if agreed[item] is not None else None
            fallback[item] = source is None
            plan[item] = source
        # Where some rank lacks the agreed version, everyone takes the persisted one (shared storage).
        retry = self._agree_flags([fallback[i] for i in held])
        for item, redo in zip(held, retry):
            if redo:
                version = manifest_t["experts"].get(item) if manifest_t else None
                plan[item] = expert_source_for(item, version, [], stored, self.root, self.rank, manifest_t) \
                    if version is not None else None
        reads: dict[int, tuple[Source, set[str]]] = {}  # each source opened once, for just its items
        for item, source in plan.items():
            if error is None and source is None:
                error = f"no saved version of {item} at or before iteration {target}"
            if source is not None:
                reads.setdefault(id(source), (source, set()))[1].add(item)
        for source, items in reads.values():
            if error is None:
                try:
                    source.open(self.storage, items)
                except SourceError as exc:
                    error = str(exc)
        return plan, error

    def _dense_source(self, target: int, memory: list[Source], stored: dict[int, Source]):
        candidates = [s for s in memory if s.iteration == target] + ([stored[target]] if target in stored else [])
        problems = []
        for source in candidates:
            try:
                source.open(self.storage)
                return source, None
            except SourceError as exc:
                problems.append(str(exc))
                say(f"megatron-pec: WARNING rank {self.rank}: {exc}")
        return None, "; ".join(problems) or f"iteration {target} is not available to rank {self.rank}"

    def _agree_versions(self, best: dict[str, int | None]) -> dict[str, int | None]:
        """Per expert, the newest version every rank holding it can restore (MIN over ranks)."""
        names = [item_name(x) for x in self.e.all_experts]
        if not names:
            return {}
        t = torch.full((len(names),), NONE, dtype=torch.int64)
        for i, name in enumerate(names):
            if best.get(name) is not None:
                t[i] = best[name]
            elif name in best:
                t[i] = -1
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.e.cpu_group)
        return {n: (int(v) if 0 <= v < NONE else None) for n, v in zip(names, t.tolist()) if n in best}

    def _agree_flags(self, flags: list[bool]) -> list[bool]:
        names = [item_name(x) for x in self.e.all_experts]
        if not names:
            return []
        held = [item_name(x) for x in self.e.experts_held]
        t = torch.zeros(len(names), dtype=torch.int64)
        position = {n: i for i, n in enumerate(names)}
        for name, flag in zip(held, flags):
            t[position[name]] = int(flag)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.e.cpu_group)
        return [bool(t[position[n]]) for n in held]

    # ---- 9. restore ----------------------------------------------------------------------------
    def _restore(self, target: int, plan: dict[str, Source], model, optimizer, scheduler) -> tuple[int, float]:
        e, config = self.e, self.e.config
        dense = plan[NON_EXPERT]
        small = smallstate.loads(dense.metadata["small"])
        load_optim = not (config.no_load_optim or config.finetune)
        if load_optim:
            restore.restore_optimizer(optimizer, small["optimizer"])
        # load_state_dict replaced Adam's tensors: bind fresh views (without the optimizer, only params).
        targets = collect.live_views(e.slices, optimizer) if load_optim else self._param_views(optimizer)
        e.live = targets if load_optim else None  # re-bound at the first save once Adam has state
        by_source: dict[int, tuple[Source, set[str]]] = {}
        for s in e.slices:
            if s.name in targets:
                source = plan[s.item]
                by_source.setdefault(id(source), (source, set()))[1].add(s.name)
        for source, names in by_source.values():
            restore.copy_slices(targets, source.tensors(names))
        restore.sync_model_params(model, optimizer)
        if scheduler is not None and load_optim and small["scheduler"] is not None:
            restore.restore_scheduler(scheduler, small["scheduler"])
        if not (config.no_load_rng or config.finetune):
            restore.restore_rng(small["rng"])
        restore.restore_args(e.args, small, config.finetune)
        report = self._account(target, plan, dense)
        where = dense.kind
        older = {i: s.items[i] for i, s in plan.items() if i != NON_EXPERT and s.items[i] < target}
        line = f"megatron-pec: rank {self.rank}: restored iteration {target} from {where}"
        if older:
            line += "; experts from older versions: " + ", ".join(f"{i}@{v}" for i, v in sorted(older.items()))
        say(line)
        if report is not None and self.rank == 0:
            for text in report.format_lines():
                say(f"megatron-pec: {text}")
        e.after_restore(target)
        iteration = 0 if config.finetune else target
        return iteration, small["num_floating_point_operations_so_far"]

    def _param_views(self, optimizer):
        """--no-load-optim: restore only the main params (the model weights)."""
        optimizers = collect.distributed_optimizers(optimizer)
        views = {}
        for s in self.e.slices:
            oi, gi, dtype, bi, ei, kind, offset = s.locator
            if kind == "param":
                model_param = list(optimizers[oi].gbuf_ranges[gi][dtype][bi]["param_map"])[ei]
                views[s.name] = collect.main_param(optimizers[oi], model_param).view(-1)[offset: offset + s.numel]
        return views

    def _account(self, target: int, plan: dict[str, Source], dense: Source) -> plt.PltReport | None:
        """PLT of this restore over every expert of the model (identical on every rank), folded
        into the PEC state. Each rank knows the versions and token counts of the experts it
        holds; one MAX all-reduce per vector completes them (each expert is held somewhere)."""
        e = self.e
        experts = e.all_experts
        if not experts:
            return None
        at_target_local = cumulative_from_json(dense.metadata["tokens"])
        vectors = torch.full((3, len(experts)), -1, dtype=torch.int64)  # version, tokens at it, tokens at T
        for i, x in enumerate(experts):
            source = plan.get(item_name(x))
            if source is not None:
                vectors[0, i] = source.items[item_name(x)]
                vectors[1, i] = source.tokens_at_version(item_name(x))
            if x in at_target_local:
                vectors[2, i] = at_target_local[x]
        torch.distributed.all_reduce(vectors, op=torch.distributed.ReduceOp.MAX, group=e.cpu_group)
        version_of = {x: int(v) for x, v in zip(experts, vectors[0].tolist())}
        at_version = {x: int(c) for x, c in zip(experts, vectors[1].tolist())}
        at_target = {x: int(c) for x, c in zip(experts, vectors[2].tolist())}
        report = plt.lost_tokens(at_target, at_version, version_of, target)
        state = PecState.loads(dense.metadata["pec"])
        state.lost_tokens, state.plt = plt.accumulate(state.lost_tokens, report)
        state.recoveries += 1
        for x in at_target_local:  # this stage's snapshot level now holds exactly what was restored
            state.snapshot.saved_at[x], state.snapshot.tokens_at[x] = version_of[x], at_version[x]
        if e.config.dynamic_k and e.expert_layout is not None:
            k = plt.next_k(state.snapshot.k, state.plt, e.config.plt_threshold, e.expert_layout.num_experts)
            if k != state.snapshot.k:
                if self.rank == 0:
                    say(f"megatron-pec: accumulated PLT {state.plt:.2%} exceeds {e.config.plt_threshold:.2%}: "
                        f"Dynamic-K raises snapshot K {state.snapshot.k} -> {k}, persist K "
                        f"{state.persist.k} -> {min(k, 2 * state.persist.k)}")
                state.persist.k = min(k, 2 * state.persist.k)
                state.snapshot.k = k
        e.tokens.cumulative.update(at_target_local)
        e.pec = state
        return report

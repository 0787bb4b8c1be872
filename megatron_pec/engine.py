"""The per-process checkpoint engine: phases 1-4 of a save (plan, snapshot, notify) and applying a restore.

One ``Engine`` per trainer process, built on the first ``load_checkpoint`` or
``save_checkpoint`` (collective: every rank builds it). Building it does all
expensive set-up - the Megatron adapter's slice table, slot files with the tmpfs
preflight, the node agent - so that every save, including the first, only plans
and copies. Megatron is reached only through ``self.adapter``; node memory's
history only through the agent, which grants the slots a snapshot may write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import time
import uuid
import warnings

import numpy
import torch

from megatron_pec import faults, manifest, policy, smallstate
from megatron_pec.agent.client import AgentClient, AgentUnavailable, check_socket_path, ensure_agent
from megatron_pec.coalesce import coalesced_with_starts, run_view
from megatron_pec.config import PecConfig, PecConfigError, megatron_flag_notes
from megatron_pec.errors import CheckpointError
from megatron_pec.expert_values import ExpertValues, HeldExperts
from megatron_pec.gcpause import without_gc
from megatron_pec.items import NON_EXPERT, ExpertId, item_name
from megatron_pec.loader import LoadContext, Loader, RestoreResult, say
from megatron_pec.pec_state import Level, PecState
from megatron_pec.phases import Phases
from megatron_pec.protocol import (Begin, Begun, Flush, Flushed, Granted, Hello, JobInfo, Record, Released, Settle,
                                   SlotHeader, SnapshotReady)
from megatron_pec.slots import SlotFiles, SlotGrants, SlotSpaceError, node_dir
from megatron_pec.sources import megatron_format
from megatron_pec.stformat import layout as tensor_layout


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# How long a persistent save waits for a slot before it is skipped (warned) like a memory snapshot.
PERSISTENT_SLOT_WAIT_S = 10.0


class Engine:
    def __init__(self, args, model_chunks, optimizer):
        from megatron_pec.megatron.adapter import MegatronAdapter

        try:
            self.config = PecConfig.from_args(args)
        except PecConfigError as exc:
            raise CheckpointError(f"megatron-pec: {exc}") from None
        self.adapter = MegatronAdapter(args, model_chunks, optimizer)
        self.optimizer = optimizer  # the engine serves this optimizer; api rebuilds it for another
        if self.adapter.rank == 0:
            for line in megatron_flag_notes(args):
                print(line, file=sys.stderr, flush=True)
        self.coll = self.adapter.collectives
        self.rank, self.world_size = self.adapter.rank, self.adapter.world_size
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        self.node_rank = _env_int("GROUP_RANK", self.rank // self.local_world_size)
        self.num_nodes = self.world_size // self.local_world_size
        self.fingerprint = self._global_fingerprint(self.adapter.local_fingerprint)
        self.held_names = {x: item_name(x) for x in self.adapter.experts_held}  # formatted once, used every save
        self.expert_layout = self._expert_layout()
        self.all_experts = self._all_experts()
        # Per-expert state as arrays over this stage's experts (the layout's order): a save records,
        # plans and encodes whole arrays, whatever the number of experts.
        self.order = self.expert_layout.order if self.expert_layout else None
        self.held = HeldExperts(self.adapter.experts_held, self.order) if self.order else None
        self.cumulative = ExpertValues(self.order, numpy.zeros(len(self.order), dtype=numpy.int64)) \
            if self.order else ExpertValues()
        # Where this stage's token counts sit in the agreement's vector over all the model's experts.
        self.token_positions = torch.tensor([self.all_experts.index(ExpertId(layer, 0)) + e
                                             for layer in self.adapter.moe_layers
                                             for e in range(self.adapter.num_experts)], dtype=torch.int64)
        self.pec = self._initial_pec_state()
        self.node_dir = node_dir(self.config.shm_dir, self.config.job_id, self.node_rank)
        self.save_root = os.path.abspath(self.config.save) if self.config.save else ""
        self.replicas = self._replicas()
        self.layout = self.adapter.layout_record(self.fingerprint)
        self.rewrite_all = False  # restored from another layout: the next saves write every expert
        self.agent = AgentClient(self.node_dir, self.rank)
        self.files: SlotFiles | None = None
        self.pinning = None  # SlotPinning on GPU
        self.grants = SlotGrants()
        self.run: str | None = None            # this process's timeline, from its first Begin
        self.resumed_from: int | None = None
        self.begins_unanswered = 0             # Begins sent whose Begun has not arrived (see _tell_timeline)
        self.stats = {"saves": 0, "skipped": 0, "persist_errors": 0}
        self.save_phases = Phases()     # where the latest save's time went (benchmarks read them)
        self.restore_phases = Phases()  # ... and the latest restore's
        # On GPU a snapshot completes lazily, before the next optimizer step (see finish_snapshot);
        # MEGATRON_PEC_DEFER_SNAPSHOT=1 exercises the same path on CPU in the tests.
        self.copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.deferred = self.copy_stream is not None or os.environ.get("MEGATRON_PEC_DEFER_SNAPSHOT") == "1"
        self.pending = None
        self.written_into: dict[int, set[str]] = {}  # slot -> items written since the agent last had it
        self._runs: dict[int, dict[str, tuple[list, list]]] = {}  # slot -> item -> its copies (see _copy_lists)
        self._runs_of = None  # the live views those copies read
        self._run_starts = None  # item -> the first slice and size of each run, and its live views
        if self.deferred:
            self.adapter.before_each_step(self.finish_snapshot)
        if self.config.save:
            self._record_layout()
            self._start_memory_tier()

    # ---- set-up --------------------------------------------------------------------------------
    def _expert_layout(self) -> policy.ExpertLayout | None:
        # Same number on every rank: the largest expert footprint of any rank (all experts are equal-sized).
        # Every rank joins the reduction, also a pipeline stage without MoE layers.
        (expert_bytes,) = self.coll.reduce([self.adapter.expert_bytes()], "max")
        if not self.adapter.moe_layers:
            return None
        return policy.ExpertLayout(layers=tuple(self.adapter.moe_layers), num_experts=self.adapter.num_experts,
                                   ep_size=self.adapter.ep_size, expert_bytes=max(1, expert_bytes))

    def _all_experts(self) -> list[ExpertId]:
        """Every expert of the model, across pipeline stages (each stage only sees its own layers);
        the index space of the cross-rank vectors."""
        layers = sorted({x for row in self.coll.gather(self.adapter.moe_layers, 4096) for x in row if x >= 0})
        (experts,) = self.coll.reduce([self.adapter.num_experts], "max")
        return [ExpertId(layer, e) for layer in layers for e in range(experts)]

    def _global_fingerprint(self, local: str) -> str:
        """One configuration id for the whole job: every rank's slice layout, hashed together."""
        every = self.coll.gather([int(local[:15], 16)], 1)
        return hashlib.sha256(",".join(str(row[0]) for row in every).encode()).hexdigest()[:16]

    def _initial_pec_state(self) -> PecState:
        n = self.adapter.num_experts or 1
        snap_k = min(self.config.snapshot_k or n, n)
        persist_k = min(self.config.persist_k or snap_k, snap_k)
        if self.config.snapshot_k and self.config.snapshot_k > n:
            warnings.warn(f"megatron-pec: --pec-snapshot-k {self.config.snapshot_k} exceeds the {n} experts per "
                          f"layer; saving all of them", stacklevel=3)
        state = PecState(Level(snap_k), Level(persist_k))
        return state.laid_out(self.order) if self.order else state

    def _replicas(self) -> int:
        """Copies of each snapshot in other nodes' memory: --pec-replicas, by default 1 across nodes."""
        wanted = self.config.replicas
        if self.num_nodes == 1:
            if wanted and self.rank == 0:
                warnings.warn(f"megatron-pec: --pec-replicas {wanted} ignored: the job runs on one node, there is "
                              "no peer to hold replicas", stacklevel=3)
            return 0
        return min(1 if wanted is None else wanted, self.num_nodes - 1)

    def _hello(self) -> Hello:
        return Hello(self.rank, JobInfo(
            job_id=self.config.job_id, fingerprint=self.fingerprint, save=self.save_root,
            local_world_size=self.local_world_size, node_rank=self.node_rank, num_nodes=self.num_nodes,
            topology=self.adapter.topology, keep=self.config.keep, replicas=self.replicas,
            domain=self.config.failure_domain or "", replica_mbps=self.config.replica_mbps))

    def _record_layout(self) -> None:
        """Where this rank's stored tensors lie in the global parameters, once per configuration under
        --save (what ``export`` and restores onto another topology read)."""
        error = None
        try:
            manifest.write_rank_layout(self.save_root, self.layout)
        except OSError as exc:
            error = f"megatron-pec: cannot write under --save {self.save_root}: {exc.strerror or exc}"
        self.coll.raise_if_any(error)

    def _start_memory_tier(self) -> None:
        entries = tensor_layout([(s.name, s.dtype, s.numel) for s in self.adapter.slot_slices])
        error = None
        try:
            check_socket_path(self.node_dir)
            self.files = SlotFiles(self.node_dir, self.rank, entries, self.local_world_size, self.replicas,
                                   reserve=self._header_reserve())
            if torch.cuda.is_available():
                self._pin_slots()
            ensure_agent(self.node_dir, self.node_rank, self.config.agent_idle_timeout, self.config.keep_shm)
            self.agent.connect(self._hello())
        except SlotSpaceError as exc:
            error = str(exc)
        except AgentUnavailable as exc:
            error = f"megatron-pec: {exc}"
        self.coll.raise_if_any(error)

    def _header_reserve(self) -> int:
        """Header room for a save's metadata, sized now so that no save runs out of it: per expert this
        rank holds, its version in ``items`` (the name and a number, escaped once more inside the metadata
        string), its name in the packed token counts and PEC state, and five base64 int64 values; plus
        the small state. (The bound of the JSON form these replaced, which keeps the slots' size.)"""
        longest = max((len(name) for name in self.held_names.values()), default=0)
        per_expert = 6 * (longest + 28)
        return per_expert * len(self.held_names) + 2 * self.adapter.small_state_bound() + (16 << 10)

    def _pin_slots(self) -> None:
        """Page-lock the slot mappings so device-to-host copies run asynchronously at full speed (a
        failure is one warning; copies are then synchronous)."""
        from megatron_pec.pinning import SlotPinning, TorchCudart, slot_ranges

        self.pinning = SlotPinning(TorchCudart(), self.rank)
        self.pinning.pin(slot_ranges(self.files.maps))

    def _begin(self, resumed_from: int | None) -> None:
        """Start this process's next timeline (after every restore, or from scratch): snapshots of
        other timelines after ``resumed_from`` are abandoned - never restored, overwritten first."""
        self.run, self.resumed_from = uuid.uuid4().hex[:16], resumed_from
        self._tell_timeline()

    def _tell_timeline(self) -> None:
        """Tell the agent which timeline this process writes (again after a reconnect: repeating it
        changes nothing on the agent's side). Its answer, the slots it grants, is taken before the
        next save (``_await_begun``): a restore does not wait for the carry the agent is running."""
        if not self.agent.connected:
            return
        self.grants.revoke_all()
        if self.agent.send(Begin(self.run, self.resumed_from)):
            self.begins_unanswered += 1

    def _await_begun(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.begins_unanswered and self.agent.connected and time.monotonic() < deadline:
            self._collect_releases(block_s=0.5)

    # ---- save ----------------------------------------------------------------------------------
    @without_gc
    def save(self, iteration: int, scheduler, flops: float, persistent: bool, rng_key_prefix: str = "") -> None:
        if not self.config.save:
            raise CheckpointError("megatron-pec: save_checkpoint was called but --save is not set")
        phases = self.save_phases = Phases()
        with phases("previous snapshot"):  # (deferred: the previous one completes here, else nothing)
            self.finish_snapshot()
        with phases("slot"):
            self._collect_releases()
            if self.run is None:
                self._begin(None)  # no load_checkpoint before: this run starts from scratch
            slot, why = None, None
            if not self.agent.connected and not self._reconnect():
                why = "the node agent is not running"
            elif (slot := self._free_slot(persistent)) is None:
                why = ("all snapshot slots are still held by the node agent (being persisted or sent to a peer, or "
                       "kept for recovery); raise the save interval or pass --pec-wait-for-slot")
        # All ranks snapshot or none does: the PEC bookkeeping must stay identical everywhere. The
        # agreement's all-reduce runs while the dense state (written by every snapshot, whatever the
        # plan) is copied; a plan that reads token counts waits for it, one that does not (sequential)
        # is made and copied before (a skipped snapshot leaves its slot marked "being written").
        with phases("agreement"):
            vote = self._start_agreement(why is None)
        token_blind = self.config.selection in policy.TOKEN_BLIND
        live, done, planned = None, None, None
        if slot is not None:
            with phases("copy"):
                live = self.adapter.live_views()
                faults.point("snapshot_begin", iteration=iteration)
                self.files.invalidate(slot)
                done = self._copy(slot, live, {NON_EXPERT})
                faults.point("snapshot_mid", iteration=iteration)
            if token_blind:  # (``self.cumulative`` is not read; the agreement updates it later)
                with phases("plan"):
                    planned = self._plan(persistent, self.cumulative)
                    experts = self._held_items(planned[0])
                with phases("copy"):
                    done = self._copy(slot, live, experts) or done
        with phases("agreement"):
            everyone_can, cumulative = self._finish_agreement(vote)
        if not everyone_can:
            if slot is not None:
                self.grants.add([slot])  # still ours; its header says "being written", never restorable
            self._skip(iteration, why or "another rank cannot snapshot (see its warning)")
            return
        if planned is None:
            with phases("plan"):
                planned = self._plan(persistent, cumulative)
                experts = self._held_items(planned[0])
            with phases("copy"):
                done = self._copy(slot, live, experts) or done
        snapshot_set, persist_set = planned
        self.rewrite_all = self.rewrite_all and not persistent
        written = {NON_EXPERT} | experts
        faults.point("snapshot_end", iteration=iteration)
        with phases("metadata"):
            self.pec.snapshot.record(snapshot_set, iteration, cumulative)
            if persistent:
                self.pec.persist.record(persist_set, iteration, cumulative)
            header = SlotHeader(
                job_id=self.config.job_id, fingerprint=self.fingerprint, save=self.save_root, rank=self.rank,
                world_size=self.world_size, iteration=iteration, items=dict.fromkeys(sorted(written), iteration),
                tokens=self.held.column(cumulative) if self.held else {},
                small=smallstate.dumps(self.adapter.small_state(scheduler, iteration, flops, rng_key_prefix)),
                pec=self.pec.dumps(self.held), run=self.run)
            persist_items = sorted(item_name(e) for e in persist_set) if persistent and self.expert_layout else None
            # (only what skipped attempts wrote besides ``written``: usually nothing, the header names the rest)
            announcement = SnapshotReady(slot, iteration, persistent, persist_items,
                                         sorted(self.written_into[slot] - written))
        self.pending = (slot, header, announcement, done)
        if not self.deferred:
            with phases("hand-off"):
                self.finish_snapshot()

    def _start_agreement(self, ok: bool):
        """The one collective of a save, started: a single small all-reduce over all ranks that sums
        the token counts since the last save and the number of ranks that cannot snapshot."""
        n = len(self.all_experts)
        values = torch.zeros(n + 1, dtype=torch.int64)
        values[self.token_positions] = self.adapter.tokens.take().reshape(-1)
        values[n] = 0 if ok else 1
        return self.coll.start_reduce(values, "sum")

    def _finish_agreement(self, vote) -> tuple[bool, ExpertValues]:
        """(every rank can snapshot, cumulative token counts) once the agreement's all-reduce ends."""
        totals = vote.reduced()
        self.cumulative.add((totals[self.token_positions] // self.adapter.token_replicas).numpy())
        return int(totals[-1]) == 0, self.cumulative

    def _copy(self, slot: int, live: dict, items: set[str]):
        """Copy the slices of ``items`` into the slot; returns the CUDA event marking the end (None
        on CPU, where the copy is a synchronous memcpy, and when there is nothing to copy)."""
        self.written_into.setdefault(slot, set()).update(items)  # (before: a copy cut short changed them too)
        dst, src = self._copy_lists(slot, live, items)
        if not dst:
            return None
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the optimizer step that produced the state
        # (no_grad: main params require grad, and autograd would record every copy - ~150 us each)
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # One call, not one per slice: a large MoE rank holds tens of thousands of slices.
            torch._foreach_copy_(dst, src, non_blocking=True)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _copy_lists(self, slot: int, live: dict, written: set[str]) -> tuple[list, list]:
        """(slot views, live views) of the written items, item by item, each run of slices that is
        contiguous on both sides as one pair (``coalesce``); built once per slot and binding of the
        live views (none is kept of an old binding: it would keep the replaced tensors alive)."""
        if self._runs_of is not live:
            self._runs, self._runs_of, self._run_starts = {}, live, None
        runs = self._runs.get(slot)
        if runs is None:
            runs = self._runs[slot] = self._slot_runs(slot, live)
        items = [item for item in written if item in runs]  # (a few of the rank's thousands)
        return [v for item in items for v in runs[item][0]], [v for item in items for v in runs[item][1]]

    def _slot_runs(self, slot: int, live: dict) -> dict[str, tuple[list, list]]:
        """Per item, (slot views, live views) of its runs. The first slot coalesces its slices; the
        others take the same runs at the same offsets of their own mapping (every slot has one
        layout): a view per run, not the walk over every slice (0.4 s at 90k slices)."""
        views = self.files.views[slot]
        if self._run_starts is not None:
            return {item: ([run_view(views[name], numel) for name, numel in zip(names, numels)], src)
                    for item, (names, numels, src) in self._run_starts.items()}
        pairs: dict[str, tuple[list, list, list]] = {}
        for s in self.adapter.slot_slices:
            dst, src, names = pairs.setdefault(s.item, ([], [], []))
            dst.append(views[s.name])
            src.append(live[s.name])
            names.append(s.name)
        runs, self._run_starts = {}, {}
        for item, (dst, src, names) in pairs.items():
            run_dst, run_src, starts = coalesced_with_starts(dst, src)
            runs[item] = (run_dst, run_src)
            self._run_starts[item] = ([names[i] for i in starts], [t.numel() for t in run_dst], run_src)
        return runs

    @without_gc
    def finish_snapshot(self) -> None:
        """Complete the pending snapshot: wait for its copies, write its header, hand it to the agent.

        On GPU this runs just before the next optimizer step mutates the state (a step
        pre-hook), so the device-to-host copies overlap the next forward/backward.
        """
        if self.pending is None:
            return
        slot, header, announcement, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()
        self.files.write_header(slot, header.to_metadata())
        if not self.agent.send(announcement):
            self.grants.revoke_all()
            self._skip(header.iteration, "the node agent died")
            return
        self.written_into.pop(slot, None)  # the agent's now; its next grant starts clean
        self.stats["saves"] += 1

    def _plan(self, persistent: bool, cumulative) -> tuple[frozenset, frozenset]:
        """(experts to snapshot, the subset to persist); changes nothing (the save may be skipped)."""
        if self.expert_layout is None:
            return frozenset(), frozenset()
        if self.rewrite_all:  # (until a persistent save has written them all)
            every = frozenset(self.expert_layout.all_experts())
            return every, every if persistent else frozenset()
        budget = None
        if self.config.budget_mb is not None:
            budget = int(self.config.budget_mb * 2**20)
        return self.pec.plan(self.config.selection, self.expert_layout, cumulative, persistent, budget)

    def _held_items(self, experts) -> set[str]:
        """The item names of the ``experts`` this rank holds."""
        return {self.held_names[e] for e in experts if e in self.held_names}

    def _free_slot(self, persistent: bool) -> int | None:
        """A granted slot. With --pec-wait-for-slot a save waits for one; without, a persistent save
        (what the user asked to keep, e.g. the last one of training) waits up to PERSISTENT_SLOT_WAIT_S
        (a slot freed while none was asked for is granted only with the agent's next message),
        a memory snapshot not at all."""
        self._await_begun()
        slot = self.grants.take()
        deadline = time.monotonic() + (PERSISTENT_SLOT_WAIT_S if persistent else 0.0)
        while slot is None and (self.config.wait_for_slot or time.monotonic() < deadline) and self.agent.connected:
            self._collect_releases(block_s=1.0)
            slot = self.grants.take()
        return slot

    def _collect_releases(self, block_s: float = 0.0) -> None:
        self._handle(self.agent.poll(block_s))

    def _handle(self, messages: list[Record]) -> None:
        for msg in messages:
            if isinstance(msg, Begun):
                # Only the answer to the last Begin grants: slots granted before the agent knew this
                # timeline, or under an earlier Begin of it, were revoked when it was sent.
                self.begins_unanswered -= 1
                if not self.begins_unanswered:
                    self.grants.add(msg.grants)
                continue
            if not isinstance(msg, (Released, Granted)):
                continue
            if not self.begins_unanswered:
                self.grants.add(msg.grants)
            if isinstance(msg, Released) and msg.error is not None:
                self.stats["persist_errors"] += 1
                print(f"megatron-pec: WARNING rank {self.rank}: snapshot of iteration {msg.iteration} was not "
                      f"persisted: {msg.error}; training continues and the next save tries again",
                      file=sys.stderr, flush=True)
        if not self.agent.connected:
            self.grants.revoke_all()
            self.begins_unanswered = 0

    def _reconnect(self) -> bool:
        try:
            ensure_agent(self.node_dir, self.node_rank, self.config.agent_idle_timeout, self.config.keep_shm,
                         timeout=10.0)
            self.agent.connect(self._hello(), timeout=5.0)
        except AgentUnavailable:
            return False
        print(f"megatron-pec: rank {self.rank} connected to a new node agent (pid {self.agent.pid})",
              file=sys.stderr, flush=True)
        self.begins_unanswered = 0  # the old agent's answers will never come
        if self.run is not None:
            self._tell_timeline()  # same timeline, new agent
        return True

    def _skip(self, iteration: int, why: str) -> None:
        self.stats["skipped"] += 1
        print(f"megatron-pec: WARNING rank {self.rank}: skipped the snapshot of iteration {iteration}: {why}",
              file=sys.stderr, flush=True)

    def flush(self, timeout: float = 300.0) -> None:
        """Wait for the agent to finish everything announced so far (by earlier trainers too):
        persisted, committed, carried and recorded."""
        self.finish_snapshot()
        _, others = self.agent.request(Flush(), Flushed, timeout)
        self._handle(others)

    def settle(self, timeout: float = 300.0) -> None:
        """Wait until the agent has recorded every snapshot announced so far (what a restore reads),
        not for the experts it still carries forward into them."""
        self.finish_snapshot()
        _, others = self.agent.request(Settle(), Flushed, timeout)
        self._handle(others)

    # ---- load ----------------------------------------------------------------------------------
    @without_gc
    def load(self, root: str | None, scheduler, rng_key_prefix: str = "",
             pretrained: str | None = None) -> tuple[int, float]:
        """Restore the newest state every rank can restore from ``root`` (collective); returns
        ``(iteration, flops)``, ``(0, 0)`` when there is none. Starts this process's timeline.

        ``pretrained`` (--pretrained-checkpoint): when ``root`` holds nothing, fine-tune from it,
        as Megatron does; it must then hold a megatron-pec checkpoint."""
        phases = self.restore_phases = Phases()
        with phases("waiting for the agent"):
            self.settle()
        with phases("the rest of the loader"):  # (the loader's own phases inside)
            result = Loader(self._load_context(phases), root).load() if root else None
        if result is None and pretrained:
            if self.rank == 0:
                say(f"megatron-pec: no checkpoint under --load {root}; fine-tuning from --pretrained-checkpoint "
                    f"{pretrained} (weights only, iteration 0)")
            self.config = dataclasses.replace(self.config, finetune=True)
            with phases("the rest of the loader"):
                result = Loader(self._load_context(phases), pretrained).load()
            if result is None:
                raise CheckpointError(
                    f"megatron-pec: --pretrained-checkpoint {pretrained} holds no megatron-pec checkpoint; "
                    "megatron-pec cannot read Megatron's own formats yet: load it once with unpatched Megatron-LM "
                    "and save with megatron-pec, or point --pretrained-checkpoint at a megatron-pec --save directory")
        if result is None:
            self._begin(None)
            return 0, 0
        return self._apply(result, scheduler, rng_key_prefix, phases)

    def megatron_checkpoint(self, root: str) -> str | None:
        """What ``root`` holds when it is Megatron's own checkpoint and no megatron-pec one (collective:
        every rank must see the same)."""
        found = megatron_format(root)
        if self.coll.all_ok(found is None):
            return None
        unseen = (f"megatron-pec: rank {self.rank} does not see the Megatron checkpoint in {root} that other "
                  "ranks see: is --load on a shared file system?")
        self.coll.raise_if_any(None if found else unseen)
        return found

    def adopt(self, iteration: int) -> None:
        """Megatron's own loader restored ``iteration`` (switching to megatron-pec mid-run): continue
        from it; every later save is megatron-pec's, the first persistent one writes every expert."""
        self.flush()
        self.adapter.state_replaced()
        self.rewrite_all = True
        self._begin(iteration)

    def _load_context(self, phases: Phases | None = None) -> LoadContext:
        return LoadContext(
            rank=self.rank, node_dir=self.node_dir, job_id=self.config.job_id, fingerprint=self.fingerprint,
            topology=self.adapter.topology, config=self.config,
            slice_items={s.name: s.item for s in self.adapter.slices},
            experts_held=tuple(self.adapter.experts_held), all_experts=tuple(self.all_experts),
            num_experts=self.expert_layout.num_experts if self.expert_layout else 0, collectives=self.coll,
            layout=self.layout, mapped_slots=self.files.mapped() if self.files is not None else {},
            slot_table=self.files.table if self.files is not None else None,
            slot_views=self.files.mapped_views() if self.files is not None else {}, phases=phases or Phases())

    def _apply(self, result: RestoreResult, scheduler, rng_key_prefix: str, phases: Phases) -> tuple[int, float]:
        """Phase 9: the loader's decision into Megatron (through the adapter) and into PEC's state;
        where the restore's time went (``phases``) goes into the log."""
        config = self.config
        load_optim = not (config.no_load_optim or config.finetune)
        self.adapter.restore(result.small, result.tensors, scheduler, load_optim=load_optim,
                             load_rng=not (config.no_load_rng or config.finetune), finetune=config.finetune,
                             rng_key_prefix=rng_key_prefix, phases=phases)
        # No older file of this layout holds this rank's experts: until a persistent save has written
        # them all, a partial one would leave versions only the other layout's files hold.
        self.rewrite_all = result.resharded
        with phases("PEC state"):
            if result.pec is not None:
                self.pec = result.pec.laid_out(self.order) if self.order else result.pec
                if self.order:
                    self.cumulative.update({x: v for x, v in result.tokens_at_target.items()
                                            if x in self.order.index})
                if not config.dynamic_k:  # flags win over the restored K unless Dynamic-K owns it
                    fresh = self._initial_pec_state()
                    self.pec.set_k(fresh.snapshot.k, fresh.persist.k)
        for line in result.log_lines(self.rank):
            say(line)
        iteration = 0 if config.finetune else result.iteration
        with phases("telling the agent the new timeline"):
            self._begin(iteration)
        say(f"megatron-pec: rank {self.rank}: restore took {phases.total():.3f} s ({phases.describe()})")
        return iteration, result.small["num_floating_point_operations_so_far"]

    def close(self, detach: bool = True) -> None:
        """detach=False (the trainer is crashing): leave at once without a clean detach, so the
        agent keeps the node memory for the restart."""
        self.adapter.close()
        if self.agent.connected:
            if detach:
                self.flush()
            self.agent.close(detach=detach)
        self._release_slots()

    def _release_slots(self) -> None:
        """Unpin and unmap the slots (a rebuilt engine maps them anew); the files stay for the agent."""
        if self.files is None:
            return
        self.pending = None
        self._runs, self._runs_of, self._run_starts = {}, None, None
        if self.pinning is not None:
            self.pinning.unpin_all()
        try:
            self.files.close()
        except BufferError:
            pass  # a view of a slot is still referenced somewhere: the mapping stays until exit
        self.files = None

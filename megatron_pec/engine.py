"""The per-process checkpoint engine: phases 1-4 of a save (plan, collect, snapshot, notify).

One ``Engine`` per trainer process, built on the first ``load_checkpoint`` or
``save_checkpoint`` (collective: every rank builds it). Building it does all
expensive set-up - slice table, slot files with the tmpfs preflight, the node
agent - so that every save, including the first, only plans and copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import warnings

import torch

from megatron_pec import faults, policy, smallstate
from megatron_pec.agent.client import AgentClient, AgentUnavailable, check_socket_path, ensure_agent
from megatron_pec.config import PecConfig, PecConfigError
from megatron_pec.errors import CheckpointError
from megatron_pec.items import NON_EXPERT, ExpertId, item_name
from megatron_pec.manifest import FORMAT
from megatron_pec.megatron import collect
from megatron_pec.megatron.tokens import TokenCounter
from megatron_pec.pec_state import Level, PecState, cumulative_to_json
from megatron_pec.slots import SlotFiles, SlotRing, SlotSpaceError, node_dir, read_index
from megatron_pec.stformat import layout as tensor_layout


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class Engine:
    def __init__(self, args, model_chunks, optimizer):
        from megatron.core import parallel_state

        self.args, self.model, self.optimizer = args, model_chunks, optimizer
        try:
            self.config = PecConfig.from_args(args)
        except PecConfigError as exc:
            raise CheckpointError(f"megatron-pec: {exc}") from None
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        self.node_rank = _env_int("GROUP_RANK", self.rank // self.local_world_size)
        self.num_nodes = self.world_size // self.local_world_size
        # Token counts are summed over all ranks. Data-, context- and expert-parallel ranks route
        # different tokens, pipeline stages different layers; tensor-parallel ranks route the same
        # tokens unless sequence parallelism splits the sequence among them: count those once.
        sequence_parallel = getattr(model_chunks[0].config, "sequence_parallel", False)
        self.token_replicas = 1 if sequence_parallel else parallel_state.get_tensor_model_parallel_world_size()
        # Agreement collectives run on CPU tensors whatever the training backend is.
        self.cpu_group = torch.distributed.new_group(backend="gloo")

        self.slices = collect.build_slices(model_chunks, optimizer)
        self.live: dict[str, torch.Tensor] | None = None  # bound at the first save / after a restore
        self.topology = collect.topology()
        self.fingerprint = self._global_fingerprint(collect.fingerprint(self.slices, self.topology))
        self.tokens = TokenCounter(model_chunks)
        self.experts_held = sorted({s.expert for s in self.slices if s.expert is not None})
        self.held_names = {x: item_name(x) for x in self.experts_held}  # formatted once, used every save
        self.expert_layout = self._expert_layout()
        self.all_experts = self._all_experts()
        self.token_offsets = [self.all_experts.index(ExpertId(layer, 0)) for layer in self.tokens.layers]
        self.pec = self._initial_pec_state()
        self.node_dir = node_dir(self.config.shm_dir, self.config.job_id, self.node_rank)
        self.agent = AgentClient(self.node_dir, self.rank)
        self.files: SlotFiles | None = None
        self.ring = SlotRing.empty()
        self.stats = {"saves": 0, "skipped": 0, "persist_errors": 0}
        # On GPU a snapshot completes lazily, before the next optimizer step (see finish_snapshot);
        # MEGATRON_PEC_DEFER_SNAPSHOT=1 exercises the same path on CPU in the tests.
        self.copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.deferred = self.copy_stream is not None or os.environ.get("MEGATRON_PEC_DEFER_SNAPSHOT") == "1"
        self.pending = None
        if self.deferred:
            for opt in collect.distributed_optimizers(optimizer):
                opt.optimizer.register_step_pre_hook(lambda *_: self.finish_snapshot())
        if self.config.save:
            self._start_memory_tier()

    # ---- set-up --------------------------------------------------------------------------------
    def _expert_layout(self) -> policy.ExpertLayout | None:
        if not self.tokens.layers:
            return None
        from megatron.core import parallel_state

        per_expert = {}
        for s in self.slices:
            if s.expert is not None:
                per_expert[s.expert] = per_expert.get(s.expert, 0) + s.numel * s.dtype.itemsize
        local = max(per_expert.values(), default=0)
        # Same number on every rank: the largest expert footprint of any rank (all experts are equal-sized).
        t = torch.tensor([local], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.cpu_group)
        return policy.ExpertLayout(layers=tuple(self.tokens.layers), num_experts=self.tokens.num_experts,
                                   ep_size=parallel_state.get_expert_model_parallel_world_size(),
                                   expert_bytes=max(1, int(t.item())))

    def _all_experts(self) -> list[ExpertId]:
        """Every expert of the model, across pipeline stages (each stage only sees its own layers);
        the index space of the loader's cross-rank vectors."""
        most = 4096
        mine = torch.full((most,), -1, dtype=torch.int64)
        mine[: len(self.tokens.layers)] = torch.tensor(self.tokens.layers, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(every, mine, group=self.cpu_group)
        layers = sorted({int(x) for t in every for x in t if x >= 0})
        experts = torch.tensor([self.tokens.num_experts], dtype=torch.int64)
        torch.distributed.all_reduce(experts, op=torch.distributed.ReduceOp.MAX, group=self.cpu_group)
        return [ExpertId(layer, e) for layer in layers for e in range(int(experts))]

    def _global_fingerprint(self, local: str) -> str:
        """One configuration id for the whole job: every rank's slice layout, hashed together."""
        mine = torch.tensor([int(local[:15], 16)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(every, mine, group=self.cpu_group)
        return hashlib.sha256(",".join(str(int(t)) for t in every).encode()).hexdigest()[:16]

    def _initial_pec_state(self) -> PecState:
        n = self.tokens.num_experts or 1
        snap_k = min(self.config.snapshot_k or n, n)
        persist_k = min(self.config.persist_k or snap_k, snap_k)
        if self.config.snapshot_k and self.config.snapshot_k > n:
            warnings.warn(f"megatron-pec: --pec-snapshot-k {self.config.snapshot_k} exceeds the {n} experts per "
                          f"layer; saving all of them", stacklevel=3)
        return PecState(Level(snap_k), Level(persist_k))

    def _start_memory_tier(self) -> None:
        entries = tensor_layout([(s.name, s.dtype, s.numel) for s in self.slices])
        error = None
        try:
            check_socket_path(self.node_dir)
            self.files = SlotFiles(self.node_dir, self.rank, entries, self.local_world_size)
            if torch.cuda.is_available():
                self._pin_slots()
            ensure_agent(self.node_dir, self.node_rank, self.config.agent_idle_timeout, self.config.keep_shm)
            self.agent.connect()
        except SlotSpaceError as exc:
            error = str(exc)
        except AgentUnavailable as exc:
            error = f"megatron-pec: {exc}"
        self.raise_if_any_rank(error)
        index = read_index(self.node_dir).get(str(self.rank), {})
        for slot, record in index.items():
            self.ring.iteration[int(slot)] = record["iteration"]
        if any(i >= 0 for i in self.ring.iteration):
            self.ring.latest = max(range(len(self.ring.iteration)), key=lambda s: self.ring.iteration[s])

    def _pin_slots(self) -> None:
        """Page-lock the slot mappings so device-to-host copies run asynchronously at full speed."""
        cudart = torch.cuda.cudart()
        for m in self.files.maps:
            ptr = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
            cudart.cudaHostRegister(ptr, len(m), 0)

    def raise_if_any_rank(self, error: str | None) -> None:
        """Every rank raises (the same way) if any rank failed - no rank is left hanging."""
        if not self.everyone(error is None):
            raise CheckpointError(error or "megatron-pec: another rank failed; see its log for the reason")

    def everyone(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` on every rank (one tiny all-reduce)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return bool(flag.item())

    def _agree_and_count(self, ok: bool) -> tuple[bool, dict[ExpertId, int]]:
        """The one collective of a save: a single small all-reduce over all ranks that sums the
        token counts since the last save and the number of ranks that cannot snapshot (so all
        ranks snapshot, or none). Returns (every rank can snapshot, cumulative token counts)."""
        n, width = len(self.all_experts), self.tokens.num_experts
        values = [0] * (n + 1)
        for row, offset in zip(self.tokens.take(), self.token_offsets):
            values[offset:offset + width] = row
        values[n] = 0 if ok else 1
        vector = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(vector, group=self.cpu_group)
        totals = vector.tolist()
        rows = [[c // self.token_replicas for c in totals[offset:offset + width]] for offset in self.token_offsets]
        return totals[n] == 0, self.tokens.fold(rows)

    # ---- save ----------------------------------------------------------------------------------
    def save(self, iteration: int, optimizer, scheduler, flops: float, persistent: bool) -> None:
        if not self.config.save:
            raise CheckpointError("megatron-pec: save_checkpoint was called but --save is not set")
        self.finish_snapshot()
        self._collect_releases()
        slot, why = None, None
        if not self.agent.connected and not self._reconnect():
            why = "the node agent is not running"
        elif (slot := self._free_slot()) is None:
            why = "all snapshot slots are still being persisted (raise the save interval or pass --pec-wait-for-slot)"
        # All ranks snapshot or none does: the PEC bookkeeping must stay identical everywhere.
        everyone_can, cumulative = self._agree_and_count(why is None)
        if not everyone_can:
            self._skip(iteration, why or "another rank cannot snapshot (see its warning)")
            return
        snapshot_set, persist_set = self._plan(persistent, cumulative)
        if self.live is None:
            self.live = collect.live_views(self.slices, optimizer)
        faults.point("snapshot_begin", iteration=iteration)
        self.files.invalidate(slot)
        written = {NON_EXPERT} | {item_name(e) for e in snapshot_set}
        done = self._copy(slot, written, iteration)
        faults.point("snapshot_end", iteration=iteration)
        self.pec.snapshot.record(snapshot_set, iteration, cumulative)
        if persistent:
            self.pec.persist.record(persist_set, iteration, cumulative)
        small = collect.small_state(optimizer, scheduler, self.args, iteration, flops)
        base = self.ring.filled(slot, iteration)
        message = {
            "type": "snapshot", "rank": self.rank, "slot": slot, "iteration": iteration, "persist": persistent,
            "persist_items": sorted(item_name(e) for e in persist_set) if persistent and self.expert_layout else None,
            "save": os.path.abspath(self.config.save), "local_world_size": self.local_world_size,
            "node_rank": self.node_rank, "num_nodes": self.num_nodes, "job_id": self.config.job_id,
            "fingerprint": self.fingerprint, "topology": self.topology, "keep": self.config.keep,
            "carry": self._carry(base, written),
        }
        self.pending = (slot, iteration, self._metadata(iteration, written, small, cumulative), message, done)
        if not self.deferred:
            self.finish_snapshot()

    def _carry(self, base: int | None, written: set[str]) -> dict | None:
        """What the agent copies into the new slot from the previous snapshot, so node memory keeps
        every expert's latest version, not only the last K: each expert this save did not write,
        at the version PEC recorded for it (a base holding any other version is not used)."""
        if base is None:
            return None
        saved_at = self.pec.snapshot.saved_at
        expected = {name: saved_at[x] for x, name in self.held_names.items() if name not in written and x in saved_at}
        return {"slot": base, "iteration": self.ring.iteration[base], "items": expected} if expected else None

    def _copy(self, slot: int, written: set[str], iteration: int):
        """Copy the written items' slices into the slot; returns the CUDA event marking the end
        (None on CPU, where the copy is a synchronous memcpy)."""
        views = self.files.views[slot]
        halfway = len(self.slices) // 2
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the optimizer step that produced the state
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, s in enumerate(self.slices):
                if s.item in written:
                    views[s.name].copy_(self.live[s.name], non_blocking=True)
                if i == halfway:
                    faults.point("snapshot_mid", iteration=iteration)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def finish_snapshot(self) -> None:
        """Complete the pending snapshot: wait for its copies, write its header, tell the agent.

        On GPU this runs just before the next optimizer step mutates the state (a step
        pre-hook), so the device-to-host copies overlap the next forward/backward.
        """
        if self.pending is None:
            return
        slot, iteration, metadata, message, done = self.pending
        self.pending = None
        if done is not None:
            done.synchronize()
        self.files.write_header(slot, metadata)
        if not self.agent.send(message):
            self.ring.agent_lost()
            self._skip(iteration, "the node agent died")
            return
        self.stats["saves"] += 1

    def _plan(self, persistent: bool, cumulative) -> tuple[frozenset, frozenset]:
        if self.expert_layout is None:
            return frozenset(), frozenset()
        budget = None
        if self.config.budget_mb is not None:
            budget = int(self.config.budget_mb * 2**20)
        return self.pec.plan(self.config.selection, self.expert_layout, cumulative, persistent, budget)

    def _metadata(self, iteration: int, written: set[str], small: dict, cumulative) -> dict[str, str]:
        return {
            "format": FORMAT, "state": "complete", "job_id": self.config.job_id, "fingerprint": self.fingerprint,
            "rank": str(self.rank), "world_size": str(self.world_size), "iteration": str(iteration),
            "save": os.path.abspath(self.config.save),
            "items": json.dumps({i: iteration for i in sorted(written)}),
            "small": smallstate.dumps(small), "pec": self.pec.dumps(), "tokens": cumulative_to_json(cumulative),
        }

    def _free_slot(self) -> int | None:
        slot = self.ring.choose()
        while slot is None and self.config.wait_for_slot and self.agent.connected:
            self._collect_releases(block_s=1.0)
            slot = self.ring.choose()
        return slot

    def _collect_releases(self, block_s: float = 0.0) -> None:
        self._handle(self.agent.poll(block_s))

    def _handle(self, messages: list[dict]) -> None:
        for msg in messages:
            if msg.get("type") != "released":
                continue
            self.ring.released(msg["slot"])
            if "error" in msg:
                self.stats["persist_errors"] += 1
                print(f"megatron-pec: WARNING rank {self.rank}: snapshot of iteration {msg['iteration']} was not "
                      f"persisted: {msg['error']}; training continues and the next save tries again",
                      file=sys.stderr, flush=True)
        if not self.agent.connected:
            self.ring.agent_lost()

    def _reconnect(self) -> bool:
        try:
            ensure_agent(self.node_dir, self.node_rank, self.config.agent_idle_timeout, self.config.keep_shm,
                         timeout=10.0)
            self.agent.connect(timeout=5.0)
            print(f"megatron-pec: rank {self.rank} connected to a new node agent (pid {self.agent.pid})",
                  file=sys.stderr, flush=True)
            return True
        except AgentUnavailable:
            return False

    def _skip(self, iteration: int, why: str) -> None:
        self.stats["skipped"] += 1
        print(f"megatron-pec: WARNING rank {self.rank}: skipped the snapshot of iteration {iteration}: {why}",
              file=sys.stderr, flush=True)

    def agent_flush(self, timeout: float = 300.0) -> None:
        """Wait for the agent to finish what was announced (by earlier trainers too), so restore sees it."""
        self.finish_snapshot()
        if not self.agent.send({"type": "flush"}):
            return
        deadline = time.monotonic() + timeout
        while self.agent.connected and time.monotonic() < deadline:
            messages = self.agent.poll(block_s=0.5)
            self._handle(messages)
            if any(m.get("type") == "flushed" for m in messages):
                return

    def after_restore(self, target: int) -> None:
        """Slots newer than the restore point belong to an abandoned timeline: reuse them first.
        Flags win over the restored K unless Dynamic-K owns it."""
        self.ring.forget_after(target)
        if not self.config.dynamic_k:
            fresh = self._initial_pec_state()
            self.pec.snapshot.k, self.pec.persist.k = fresh.snapshot.k, fresh.persist.k

    def flush(self, timeout: float = 300.0) -> None:
        """Wait until the agent has released every slot (all announced persists finished)."""
        self.finish_snapshot()
        deadline = time.monotonic() + timeout
        while any(self.ring.held) and self.agent.connected and time.monotonic() < deadline:
            self._collect_releases(block_s=0.5)

    def close(self, detach: bool = True) -> None:
        """detach=False (the trainer is crashing): leave at once without a clean detach, so the
        agent keeps the node memory for the restart."""
        self.tokens.remove()
        if self.agent.connected:
            if detach:
                self.flush()
            self.agent.close(detach=detach)


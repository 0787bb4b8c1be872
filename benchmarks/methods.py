"""The checkpoint methods compared, each driven the way its own framework drives it.

Runs inside the torchrun worker, on every rank (every call is collective unless
noted). A method exposes:

* ``setup()``                 - one-time start-up (agents, savers, process pools), not timed;
* ``save(it) -> bool``        - one checkpoint of the current training state, persisted; the caller
                                times it (the blocking time); returns False if the method skipped it;
* ``snapshot(it) -> bool``    - the same into node memory only (methods with a memory tier);
* ``node_memory_bytes()``     - bytes of node memory the method holds now (None: not measurable, ``why``);
* ``wait_persisted(it)``      - block until that checkpoint is durable/committed on storage;
* ``written_bytes(it)``       - bytes this rank wrote to storage for that checkpoint;
* ``snapshot_bytes()``        - bytes this rank copied to node memory per save (None: no memory tier);
* ``restore_memory()``        - restore the newest checkpoint from node memory (None if no such tier);
* ``restore_storage()``       - restore the newest checkpoint from storage, page cache dropped first;
* ``restored_files()``        - the files (the node's) that restore reads whole: a cold read of them is its
                                floor (None: not known);
* ``close()``.

Every method checkpoints the same training state: the distributed optimizer's
shards (fp32 main params + Adam moments) plus the small state; torch_dist and the
legacy path also store the model weights, as Megatron does.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import time

import torch

from benchmarks.collective import reduce_max
from benchmarks.common import allocated_bytes, drop_file_cache, files_under

FSYNC = {"pec": True, "torch_dist": True, "legacy": False, "dlrover": False}


def barrier():
    torch.distributed.barrier()


def unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1's DistributedOptimizer.load_state_dict (torch Adam, no apex/TE) gives
    every param one shared ``step`` tensor, which torch's foreach Adam then increments once per
    param per step; the dense and expert optimizers' steps drift apart and the next
    ChainedOptimizer.load_state_dict fails its step assertion. Same fix megatron-pec applies
    after its own restores (megatron_pec/megatron/restore.py)."""
    from megatron_pec.megatron.collect import distributed_optimizers

    for opt in distributed_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its threads (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Method:
    name = "?"
    family = "?"
    has_memory = False
    persists_async = False

    def __init__(self, ctx, root: str):
        self.ctx, self.root = ctx, root
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
        barrier()
        self.skipped = 0

    def setup(self):
        pass

    @staticmethod
    def cold_start(files) -> float:
        """Drop ``files`` from the page cache on every rank, then start the restore timer."""
        barrier()
        drop_file_cache(files)
        barrier()
        return time.perf_counter()

    def snapshot_bytes(self):
        return None

    def snapshot(self, it) -> bool:
        raise NotImplementedError(f"{self.name} has no node-memory tier")

    def node_memory_bytes(self) -> int | None:
        return None

    node_memory_why = "no node-memory tier"

    def background_cpu_s(self):
        """CPU seconds used so far by the process that persists in the background (None: none)."""
        return None

    def background_cpu_phases(self):
        """That process's CPU seconds so far by what it was doing (None: not known)."""
        return None

    def phases(self, kind: str):
        """Seconds by phase of this rank's latest ``kind`` ("save", "restore"), None: not known."""
        return None

    def restore_memory(self):
        return None

    def restored_files(self) -> list[str] | None:
        return None

    def close(self):
        pass

    def cleanup(self):
        barrier()
        if self.ctx.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)
        barrier()


# ---- megatron-pec -------------------------------------------------------------------------------

class Pec(Method):
    family = "pec"
    has_memory = True
    persists_async = True

    def __init__(self, ctx, root, snapshot_k, persist_k, tag, selection="sequential", wait_for_slot=True):
        super().__init__(ctx, root)
        self.snapshot_k, self.persist_k, self.tag, self.selection = snapshot_k, persist_k, tag, selection
        self.wait_for_slot = wait_for_slot
        label = "all" if snapshot_k is None else str(snapshot_k)
        self.name = f"megatron-pec K={label}" if persist_k == snapshot_k else \
            f"megatron-pec K={label}/persist {persist_k}"
        self.engine = None
        self._job = f"bench_{ctx.run_id}_{tag}"
        self._storage_phases = None  # the latest restore from storage's

    def _args(self, job_suffix=""):
        a = copy.copy(self.ctx.args)
        a.save = a.load = self.root
        a.pec_snapshot_k, a.pec_persist_k = self.snapshot_k, self.persist_k
        a.pec_selection = self.selection
        a.pec_job_id = self._job + job_suffix
        a.pec_shm_dir = self.ctx.shm_dir
        # True: every requested checkpoint is taken; False (benchmarks.gpu's schedule): a snapshot finding
        # no free region is skipped and counted, as a training run without --pec-wait-for-slot does
        a.pec_wait_for_slot = self.wait_for_slot
        a.pec_keep = 2
        a.pec_keep_shm = False
        a.pec_agent_idle_timeout = 120.0
        return a

    def setup(self):
        from megatron_pec.engine import Engine
        from megatron_pec.store.checkpoint_dir import CheckpointDir
        from megatron_pec.store.storage import open_storage

        c = self.ctx
        self.storage = open_storage("posix")
        self.engine = Engine(self._args(), c.model, c.optimizer, self.storage)
        self.checkpoints = CheckpointDir(self.root, self.storage)
        # The first checkpoint of a run holds every expert (PEC needs a full base); take it here so
        # the measured saves are steady-state ones.
        self.save(c.next_iteration())
        self.wait_persisted(None)

    def save(self, it):
        self.last = it
        return self._save(it, persistent=True)

    def snapshot(self, it):
        return self._save(it, persistent=False)

    def _save(self, it, persistent: bool) -> bool:
        before = self.engine.stats["skipped"]
        self.engine.save(it, self.ctx.scheduler, 0, persistent=persistent)
        ok = self.engine.stats["skipped"] == before
        self.skipped += 0 if ok else 1
        return ok

    node_memory_why = "its home slots and expert pool"

    def node_memory_bytes(self):
        """This rank's share of the node's memory: its home slots and expert pool (rank 0: also the node's
        other files)."""
        if self.engine is None:
            return None
        rank = self.ctx.rank
        mine = [p for p in files_under(self.engine.job.node_dir) if os.path.basename(p).startswith(f"rank{rank}.")
                or (rank == 0 and not os.path.basename(p).startswith("rank"))]
        return allocated_bytes(mine)

    def wait_persisted(self, it):
        # Committed = the manifest exists (written after every rank file is durable). The agent
        # releases the slot later, after carrying experts forward for node memory: not waited for.
        if it is None:
            self.engine.flush()
        else:
            deadline = time.monotonic() + 300
            while not self.checkpoints.is_committed(it) and time.monotonic() < deadline:
                time.sleep(0.001)
        barrier()

    def written_bytes(self, it):
        path = self.checkpoints.rank_file(it, self.ctx.rank)
        return os.path.getsize(path) if os.path.exists(path) else 0

    def committed(self, it) -> bool:
        return self.checkpoints.is_committed(it)

    def snapshot_bytes(self):
        from megatron_pec.memory.history import NodeMemory

        memory = NodeMemory.read(self.engine.job.node_dir)
        newest = memory.newest(self.ctx.rank)
        if newest is None:
            return None
        # What the trainer copied: the items at this iteration, in its home slot and in the expert pool.
        record = memory.view(self.ctx.rank, newest[1].iteration)
        items = {i for i, version in record.items.items() if version == record.iteration}
        return sum(s.numel * s.dtype.itemsize for s in self.engine.adapter.slices if s.item in items)

    def background_cpu_s(self):
        from megatron_pec.agent.client import agent_pid

        pid = agent_pid(self.engine.job.node_dir)
        return process_cpu_s(pid) if pid else None

    def background_cpu_phases(self):
        from megatron_pec.agent.cpu_ledger import read_ledger

        self.engine.flush()  # (the agent writes its ledger when flushed)
        return read_ledger(self.engine.job.node_dir)

    def phases(self, kind: str):
        if kind == "storage restore":
            return self._storage_phases
        return dict((self.engine.save_phases if kind == "save" else self.engine.restore_phases).seconds)

    def restore_memory(self):
        c = self.ctx
        barrier()
        t = time.perf_counter()
        self.engine.load(self.root, c.scheduler)
        return reduce_max(time.perf_counter() - t)

    def restored_files(self):
        """Every rank's file of the newest committed iteration, with all experts (with K < all the restore
        also reads parts of older files: not a whole-file floor)."""
        if self.persist_k is not None:
            return None
        newest = self.checkpoints.committed_iterations()[0]
        return [self.checkpoints.rank_file(newest, r) for r in range(self.ctx.world)]

    def restore_storage(self):
        """A fresh engine whose node memory is empty (as after node loss) restores from storage;
        repeatable (each call a fresh engine)."""
        from megatron_pec.engine import Engine

        c = self.ctx
        if self.engine is not None:  # the training engine and its memory go first, as with a lost node
            node = self.engine.job.node_dir
            self.engine.close()
            self.engine = None
            _stop_agent(node)
        barrier()
        drop_file_cache(files_under(self.root))
        fresh = Engine(self._args("_cold"), c.model, c.optimizer, self.storage)
        barrier()
        t = time.perf_counter()
        fresh.load(self.root, c.scheduler)
        elapsed = reduce_max(time.perf_counter() - t)
        self._storage_phases = dict(fresh.restore_phases.seconds)
        node = fresh.job.node_dir
        fresh.close()
        _stop_agent(node)
        return elapsed

    def close(self):
        if self.engine is not None:
            node = self.engine.job.node_dir
            self.engine.close()
            self.engine = None
            _stop_agent(node)
        _stop_agent(os.path.join(self.ctx.shm_dir, self._job + "_cold", "node0"))


def _stop_agent(node_dir: str, grace_s: float = 3.0) -> None:
    """Stop the node agent this benchmark started, if it did not exit after every trainer detached
    (rank 0; SIGTERM: the agent's own clean shutdown, which removes its slots): the next method measures
    with no agent of this one left running, whatever state a failed measurement left it in. (An agent
    whose last job was a flush once counted as busy forever; ``Trainers.done`` fixed that.)"""
    from megatron_pec.testing import launch

    if torch.distributed.get_rank() == 0:
        launch.stop_agents(node_dir, sig=signal.SIGTERM, grace_s=grace_s)


# ---- megatron-core dist_checkpointing (torch_dist) -------------------------------------------

class TorchDist(Method):
    """Megatron-LM's default: ``torch_dist`` format, DistributedOptimizer ``dp_reshardable``
    sharded state dict, fully parallel save wrapper; async through AsyncCallsQueue."""

    family = "torch_dist"

    def __init__(self, ctx, root, async_save=False):
        super().__init__(ctx, root)
        self.async_save = async_save
        self.persists_async = async_save
        self.name = "torch_dist async" if async_save else "torch_dist sync"
        self.queue = None
        self.async_strategy = async_strategy() if async_save else None
        self.staging_bytes = 0  # the most a save grew the trainer's resident memory by (async: its host copies)

    def _metadata(self):
        from megatron.core import parallel_state

        return {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}

    def _state_dict(self, it, loading=False):
        c = self.ctx
        md = self._metadata()
        model_sd = c.model[0].module.sharded_state_dict(metadata=md)
        return {"model": model_sd,
                "optimizer": c.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=md),
                "opt_param_scheduler": c.scheduler.state_dict(), "iteration": it,
                "checkpoint_version": 3.0}

    def setup(self):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        self.strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"),
            parallel_state.get_data_parallel_group(with_context_parallel=True))
        if self.async_save:
            # The persistent worker calls torch.cuda.device_count() in a fresh process (0 on CPU:
            # ZeroDivisionError), so the per-save forked worker is used - Megatron's other mode.
            self.queue = async_calls_queue(self.async_strategy)(persistent=False)
        # Warm-up save: the first one also starts helper processes and caches plans.
        it = self.ctx.next_iteration()
        self.save(it)
        self.wait_persisted(it)

    def _dir(self, it):
        return os.path.join(self.root, f"iter_{it:07d}")

    def save(self, it):
        from megatron.core import dist_checkpointing

        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=True)  # one save in flight at a time
        d = self._dir(it)
        if self.ctx.rank == 0:
            os.makedirs(d, exist_ok=True)
        barrier()
        if self.async_save:
            strategy = {"async_strategy": self.async_strategy} if self.async_strategy else {}
            before = resident_bytes()
            request = dist_checkpointing.save(self._state_dict(it), d, self.strategy, async_sharded_save=True,
                                              **strategy)
            self.queue.schedule_async_request(request)
            self.staging_bytes = max(self.staging_bytes, resident_bytes() - before)
        else:
            dist_checkpointing.save(self._state_dict(it), d, self.strategy)
        self.last = it
        return True

    def poll(self):
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=False)

    node_memory_why = "host staging: the most a save grew the trainer's resident memory by (its host copies)"

    def node_memory_bytes(self):
        return self.staging_bytes if self.async_save else None

    def wait_persisted(self, it):
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)
        barrier()

    def written_bytes(self, it):
        d, r = self._dir(it), self.ctx.rank
        total = 0
        for name in os.listdir(d):
            mine = name.startswith(f"__{r}_") or (r == 0 and not name.startswith("__"))
            if mine and os.path.isfile(os.path.join(d, name)):
                total += os.path.getsize(os.path.join(d, name))
        return total

    def restored_files(self):
        return files_under(self._dir(self.last))

    def restore_storage(self):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

        c = self.ctx
        d = self._dir(self.last)
        t = self.cold_start(files_under(d))
        state = self._state_dict(self.last, loading=True)
        loaded = dist_checkpointing.load(state, d, get_default_load_sharded_strategy(d))
        with torch.no_grad():  # DistributedOptimizer copies into leaf views
            c.model[0].module.load_state_dict(loaded["model"])
            c.optimizer.load_state_dict(loaded["optimizer"])
            c.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        unshare_adam_steps(c.optimizer)
        return reduce_max(time.perf_counter() - t)

    def close(self):
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)
            self.queue.close()
            self.queue = None


# ---- Megatron's own local checkpoints (nvidia-resiliency-ext) ----------------------------------

NEEDS_CUDA = "needs CUDA: nvidia-resiliency-ext's local checkpoints assert CUDA tensors"


class MegatronLocal(TorchDist):
    """Megatron-LM's own non-persistent checkpoints (``--non-persistent-ckpt-type local``), driven as
    ``megatron/training/checkpointing.py`` (core_v0.19.0) drives them without ``--async-save``:

    * a snapshot (``--non-persistent-save-interval``): ``MCoreTensorAwareStateDict.from_state_dict`` of the
      sharded state dict (algo ``fully_parallel``, ``--non-persistent-local-ckpt-algo``'s default; no cached
      metadata: ``--ckpt-assume-constant-structure`` is off by default) handed to NVRx's
      ``LocalCheckpointManager.save``: the tensors copied to the host, one ``torch.save`` file per rank in the
      local directory (``.dirty`` then rename), a barrier, a collective ``find_latest``, the older files removed;
    * a persist (``--save-interval``): Megatron's global checkpoint instead, ``torch_dist``, synchronous as the
      local ones are (``TorchDist``);
    * a restore from memory: ``find_latest``, ``load`` and ``to_state_dict``, then the model's and the
      optimizer's ``load_state_dict`` (``_load_non_persistent_base_checkpoint``, ``load_checkpoint``); from
      storage the ``torch_dist`` checkpoint (``TorchDist.restore_storage``).

    The local directory is in ``/dev/shm`` (node memory, as the other methods' memory tiers); no replication
    (one node). CUDA only: NVRx's own state dict asserts CUDA tensors and its replication goes through
    ``.cuda()``; Megatron's fully parallel load synchronizes CUDA (``to_state_dict``). megatron-core 0.19 needs
    nvidia-resiliency-ext 0.6.0 or newer (it asserts that on import wherever NVRx is importable)."""

    family = "megatron_local"
    name = "Megatron local ckpt (NVRx)"
    has_memory = True
    persists_async = False
    ALGO = "fully_parallel"

    def __init__(self, ctx, root, local_root):
        super().__init__(ctx, root, async_save=False)
        self.name = MegatronLocal.name
        self.local_root = local_root
        self.manager = None
        self._phases = None  # the latest restore from memory's

    def setup(self):
        problems = [] if torch.cuda.is_available() else [NEEDS_CUDA]
        try:
            from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
                LocalCheckpointManager,
            )
        except ImportError as exc:
            problems.append(f"nvidia-resiliency-ext is not importable here ({exc}; scripts/gpu_wheels.sh brings it)")
        if problems:
            raise RuntimeError("; ".join(problems))
        self.manager = LocalCheckpointManager(self.local_root)
        super().setup()  # (the global strategy and a warm-up persist)
        self.snapshot(self.ctx.next_iteration())  # (a warm-up snapshot: the local directory made)

    def _group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    def snapshot(self, it):
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        state, _ = MCoreTensorAwareStateDict.from_state_dict(self._state_dict(it), algo=self.ALGO,
                                                               parallelization_group=self._group())
        self.manager.save(state, it, is_async=False)  # (returns once saved, checked on every rank, cleaned up)
        return True

    node_memory_why = "its local checkpoint file (one torch.save per rank, in /dev/shm)"

    def node_memory_bytes(self):
        return allocated_bytes(files_under(str(self.manager.local_ckpt_dir))) if self.manager else None

    def phases(self, kind: str):
        return self._phases if kind == "restore" else None

    def restore_memory(self):
        c = self.ctx
        barrier()
        t = time.perf_counter()
        latest = self.manager.find_latest()
        if latest < 0:
            raise RuntimeError("no local checkpoint is complete on every rank")
        found = time.perf_counter()
        saved, _ = self.manager.load()
        loaded = time.perf_counter()
        state = saved.to_state_dict(self._state_dict(latest, loading=True), algo=self.ALGO,
                                    parallelization_group=self._group())
        converted = time.perf_counter()
        with torch.no_grad():
            c.model[0].module.load_state_dict(state["model"])
            c.optimizer.load_state_dict(state["optimizer"])
            c.scheduler.load_state_dict(state["opt_param_scheduler"])
        unshare_adam_steps(c.optimizer)
        now = time.perf_counter()
        self._phases = {"find_latest": found - t, "load (torch.load, to the device)": loaded - found,
                        "to_state_dict": converted - loaded, "load_state_dict": now - converted}
        return reduce_max(now - t)

    def cleanup(self):
        super().cleanup()
        if self.ctx.rank == 0:
            shutil.rmtree(self.local_root, ignore_errors=True)


def async_strategy() -> str | None:
    """The ``async_strategy`` megatron-core's ``dist_checkpointing.save`` gets: "nvrx" where
    nvidia-resiliency-ext is importable, else "mcore" (0.19's default "nvrx" fails without it); None where
    ``save`` takes no such parameter (0.16.1, whose only async save is megatron-core's own)."""
    import inspect

    from megatron.core import dist_checkpointing

    if "async_strategy" not in inspect.signature(dist_checkpointing.save).parameters:
        return None
    try:
        import nvidia_resiliency_ext.checkpointing.async_ckpt.core  # noqa: F401 (imported only to see that it is installed)
    except ImportError:
        return "mcore"
    return "nvrx"


def async_calls_queue(strategy: str | None):
    """The AsyncCallsQueue class that runs the requests ``strategy``'s save returns."""
    if strategy is None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    return get_async_strategy(strategy, module="AsyncCallsQueue")[1]


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- Megatron legacy (gather to DP rank 0 + torch.save) --------------------------------------

class Legacy(Method):
    """Megatron-LM's non-distributed format with the distributed optimizer: each expert-parallel
    rank torch.saves ``model_optim_rng.pt``; ``save_parameter_state`` gathers every
    DistributedOptimizer shard to its DP rank 0 (``get_parameter_state_dp_zero``) which
    torch.saves ``distrib_optim.pt``."""

    family = "legacy"
    name = "legacy (gather to DP 0)"

    def _dir(self, it):
        from megatron.core import parallel_state

        return os.path.join(self.root, f"iter_{it:07d}",
                            f"mp_rank_00_{parallel_state.get_expert_model_parallel_rank():03d}")

    def setup(self):
        it = self.ctx.next_iteration()
        self.save(it)

    def save(self, it):
        from megatron.core import parallel_state

        c = self.ctx
        d = self._dir(it)
        os.makedirs(d, exist_ok=True)
        if parallel_state.get_expert_data_parallel_rank() == 0:
            state = {"model": c.model[0].state_dict_for_save_checkpoint(), "optimizer": c.optimizer.state_dict(),
                     "opt_param_scheduler": c.scheduler.state_dict(), "iteration": it,
                     "rng_state": [torch.get_rng_state()], "checkpoint_version": 3.0}
            torch.save(state, os.path.join(d, "model_optim_rng.pt"))
        c.optimizer.save_parameter_state(os.path.join(d, "distrib_optim.pt"))
        barrier()
        self.last = it
        return True

    def wait_persisted(self, it):
        barrier()  # synchronous: done when save returns

    def written_bytes(self, it):
        d = self._dir(it)
        return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))

    def restored_files(self):
        return files_under(os.path.dirname(self._dir(self.last)))  # (every expert-parallel rank's)

    def restore_storage(self):
        c = self.ctx
        d = self._dir(self.last)
        t = self.cold_start(files_under(d))
        state = torch.load(os.path.join(d, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
        with torch.no_grad():
            c.model[0].load_state_dict(state["model"])
            c.optimizer.load_state_dict(state["optimizer"])
            # megatron-core 0.16.1 with torch Adam (no apex/TE): _set_main_param_and_optimizer_states
            # copies every key of the live per-param state, including "step", which the legacy file
            # does not hold (KeyError: 'step'). Hide "step" while the shards are scattered in.
            hidden = _pop_steps(c.optimizer)
            c.optimizer.load_parameter_state(os.path.join(d, "distrib_optim.pt"))
            _push_steps(hidden)
            c.scheduler.load_state_dict(state["opt_param_scheduler"])
        unshare_adam_steps(c.optimizer)
        return reduce_max(time.perf_counter() - t)


def _pop_steps(optimizer):
    from megatron_pec.megatron.collect import distributed_optimizers

    hidden = []
    for opt in distributed_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:
                hidden.append((state, state.pop("step")))
    return hidden


def _push_steps(hidden):
    for state, step in hidden:
        state["step"] = step


# ---- DLRover Flash Checkpoint ------------------------------------------------------------------

class DLRover(Method):
    """DLRover's generic ``DdpCheckpointer`` (flash checkpoint: copy into shared memory, a saver
    process persists with torch.save), fed this rank's optimizer shard tensors and small state."""

    family = "dlrover"
    name = "DLRover flash ckpt"
    has_memory = True
    _phases = None  # the latest restore from memory's
    _storage_phases = None  # ... and from storage
    persists_async = True

    def setup(self):
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        c = self.ctx
        world = c.world
        self.ckpt = DdpCheckpointer(self.root, local_shard_num=world, global_shard_num=world)
        it = c.next_iteration()
        self.save(it)
        self.wait_persisted(it)

    def _state(self, it):
        from megatron_pec.megatron import collect

        c = self.ctx
        live = c.live_views()
        state = dict(live)
        state["small"] = collect.small_state(c.optimizer, c.scheduler, c.args, it, 0).dumps()
        return state

    def save(self, it):
        # What DdpCheckpointer.save_checkpoint(step, state, path, StorageType.DISK) does, calling its
        # engine directly because only the engine's return value says whether the memory copy
        # happened (DLRover skips it while its saver still persists the previous step).
        ok = self._save(it, self.ckpt._engine.save_to_storage)
        if ok:
            self.last = it
        return ok

    def snapshot(self, it):
        # ... and what save_checkpoint(step, state, path, StorageType.MEMORY) does
        return self._save(it, self.ckpt._engine.save_to_memory)

    def _save(self, it, engine_call) -> bool:
        from dlrover.python.common.constants import CheckpointConstant

        path = os.path.join(self.root, str(it), f"rank_{self.ctx.rank}.pt")
        key = CheckpointConstant.MODEL_STATES_NAME
        ok = bool(engine_call(it, {key: self._state(it)}, {key: path}))
        self.skipped += 0 if ok else 1
        return ok

    node_memory_why = "its shared-memory buffer"

    def node_memory_bytes(self):
        shm = self.ckpt._engine._shm_handler.shared_memory
        if shm is None:
            return None
        return allocated_bytes([os.path.join("/dev/shm", shm.name.lstrip("/"))]) or shm.size

    def wait_persisted(self, it, timeout=300.0):
        from dlrover.python.common.constants import CheckpointConstant

        tracker = os.path.join(self.root, CheckpointConstant.TRACER_FILE_NAME)
        deadline = time.monotonic() + timeout
        want = str(self.last)  # the newest step whose memory copy happened (skipped steps never commit)
        while time.monotonic() < deadline:
            try:
                with open(tracker) as f:
                    if f.read().strip() == want:
                        break
            except OSError:
                pass
            time.sleep(0.002)
        else:
            raise TimeoutError(f"DLRover did not commit step {want} within {timeout:.0f}s")
        barrier()

    def written_bytes(self, it):
        path = os.path.join(self.root, str(it), f"rank_{self.ctx.rank}.pt")
        return os.path.getsize(path) if os.path.exists(path) else 0

    def snapshot_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.ctx.live_views().values())

    def _apply(self, state) -> tuple[float, float]:
        """The loaded state into the job: (seconds copying, seconds of the param sync)."""
        from megatron_pec.megatron.collect import distributed_optimizers

        c = self.ctx
        t = time.perf_counter()
        live = c.live_views()
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(state[name])
        copied = time.perf_counter()
        # Megatron's own param sync after a load (what a DLRover user runs), not megatron-pec's
        for opt in distributed_optimizers(c.optimizer):
            opt._copy_main_params_to_model_params()
        for chunk in c.model:
            chunk.start_param_sync(force_sync=True)
        return copied - t, time.perf_counter() - copied

    def phases(self, kind: str):
        return {"restore": self._phases, "storage restore": self._storage_phases}.get(kind)

    def restore_memory(self):
        barrier()
        t = time.perf_counter()
        state = self.ckpt.load_checkpoint()
        loaded = time.perf_counter() - t
        copy, sync = self._apply(state)
        self._phases = {"reading node memory": loaded, "copy": copy, "param sync": sync}
        return reduce_max(time.perf_counter() - t)

    def restored_files(self):
        return [os.path.join(self.root, str(self.last), f"rank_{r}.pt") for r in range(self.ctx.world)]

    def restore_storage(self):
        path = os.path.join(self.root, str(self.last), f"rank_{self.ctx.rank}.pt")
        t = self.cold_start([path])
        state = self.ckpt._engine._load_from_storage()  # what load_checkpoint does without node memory
        loaded = time.perf_counter() - t
        copy, sync = self._apply(state)
        self._storage_phases = {"reading storage": loaded, "copy": copy, "param sync": sync}
        return reduce_max(time.perf_counter() - t)

    def close(self):
        try:
            # DLRover leaves its segment in /dev/shm when its trainer ends (as large as the state: 1.8 GB
            # per rank on the GPU model): removed here, after the restores that read it
            self.ckpt._engine._shm_handler.unlink()
        except Exception:
            pass
        try:
            self.ckpt._engine.close()
        except Exception:
            pass

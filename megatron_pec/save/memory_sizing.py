"""This rank's node memory, planned once at start-up by every rank (``Engine._start_memory_tier``).

``memory/budget.py`` is the arithmetic (pure); this module supplies its inputs from the running job - the
home file and snapshot sizes with the header's room for a save's metadata, the node's state gathered
from its local ranks (a collective), the policy's per-snapshot demand - checks a ``--pec-node-memory``
budget against the tmpfs, and reports the plan (a start-up line per node, ``rank<r>.memory.json`` for
``python -m megatron_pec inspect``).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from functools import partial

from megatron_pec.common import log
from megatron_pec.config import PecConfig
from megatron_pec.format.stformat import encode_header
from megatron_pec.job_facts import JobFacts
from megatron_pec.memory import budget
from megatron_pec.memory.node_files import memory_sizing_name, replace_node_file
from megatron_pec.memory.slot_map import SlotMap
from megatron_pec.memory.slots import home_file_bytes, snapshot_file_bytes, tmpfs_room


def header_reserve(job: JobFacts, small_state_bound: int) -> int:
    """Header room for a save's metadata, sized now so that no save runs out of it and no more (node memory
    holds two home headers per rank): per expert this rank holds, its version in ``items`` (the name and a
    number, escaped once more inside the metadata string), its name in the packed token counts and PEC
    state, and five base64 int64 values; the small state (``small_state_bound``: the most it takes in the
    header); and the record's other fields (ids, the save path, the dense items' checksums)."""
    longest = max((len(name) for name in job.held_names.values()), default=0)
    per_expert = 6 * (longest + 28)
    return per_expert * len(job.held_names) + small_state_bound + 2 * len(job.save_root) + (6 << 10)


def plan(job: JobFacts, config: PecConfig, collectives, layout: SlotMap, asked_k: int, ep_rank: int,
         reserve: int) -> tuple[budget.MemorySizing | None, str | None]:
    """This rank's node memory for the asked snapshot K, or the K a --pec-node-memory budget holds;
    (plan, None) or (None, what is wrong). Collective: the node's state is every local rank's."""
    home_file = home_file_bytes(layout.dense, reserve)
    state = snapshot_file_bytes(layout, reserve)
    header = 8 + len(encode_header(replace(layout, regions=2 * len(layout.experts)).pool_entries(),
                                   layout.pool_metadata()))
    held = len(layout.experts)
    demand = partial(budget.per_snapshot, job.expert_layout, config.selection, ep_rank=ep_rank, held=held)
    # A node keeps a replica, the state's size, of each rank of ``replicas`` peer nodes (``replica_transport.py``).
    replica_share = job.replicas * state
    least = budget.least_bytes(home_file, layout.homes, header, layout.region_bytes, held, lambda k: demand(k=k),
                               replica_share)
    # (each rank's least too: a budget is shared equally, so the node's smallest is its neediest rank's times
    # the local ranks, the same number in every rank's refusal)
    gathered = collectives.gather([state, least], 2)
    node = [gathered[r] for r in range(job.node_rank * job.local_world_size,
                                       (job.node_rank + 1) * job.local_world_size) if r < len(gathered)]
    node_state = sum(values[0] for values in node)
    node_least = max(values[1] for values in node) * job.local_world_size
    try:
        planned = budget.plan(state, home_file, layout.homes, header, layout.region_bytes, held,
                              lambda k: demand(k=k), asked_k, config.node_memory, node_state, job.local_world_size,
                              replica_share, node_least)
    except budget.BudgetError as exc:
        return None, str(exc)
    if config.node_memory is not None:
        asked_bytes = config.node_memory.bytes_for(node_state)
        os.makedirs(job.node_dir, exist_ok=True)
        held_now = sum(e.stat().st_size for e in os.scandir(job.node_dir) if e.is_file())
        room = tmpfs_room(job.node_dir)[0] + held_now
        if asked_bytes > room:
            return None, (f"--pec-node-memory {config.node_memory} asks for {asked_bytes / 2**30:.2f} GiB of node "
                          f"memory; the tmpfs {config.shm_dir} has {room / 2**30:.2f} GiB for it. Lower the budget "
                          "or enlarge the tmpfs (for Docker: --shm-size)")
    return planned, None


def report(planned: budget.MemorySizing, job: JobFacts, on_gpu: bool) -> None:
    """The node memory planned: said once per node at start-up, and kept beside the files for ``inspect``."""
    replace_node_file(os.path.join(job.node_dir, memory_sizing_name(job.rank)), json.dumps(planned.record()))
    if job.rank % job.local_world_size == 0:
        log.info(planned.describe(job.local_world_size, on_gpu, tmpfs_room(job.node_dir)), rank=job.rank)


__all__ = ["header_reserve", "plan", "report"]

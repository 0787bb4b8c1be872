"""The job as one trainer sees it, worked out once at start-up: who it is, what the model's experts
are, which configuration it runs. Every rank builds it (collective: a few tiny gathers and
reductions); saves and restores only read it.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import torch

from megatron_pec.common import log
from megatron_pec.config import PecConfig
from megatron_pec.format.checkpoint_paths import absolute
from megatron_pec.format.item_names import ExpertId, ExpertOrder, item_name
from megatron_pec.format.protocol import Hello, JobInfo, RankLayout
from megatron_pec.memory.slots import node_dir
from megatron_pec.pec import policy
from megatron_pec.pec.expert_values import HeldExperts


@dataclass(frozen=True, eq=False)
class JobFacts:
    rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    topology: dict
    fingerprint: str                   # one configuration id for the whole job
    session: str                       # this launch, the same on every rank (names its saves' files)
    layout: RankLayout                 # where this rank's slices lie in the global parameters
    expert_layout: policy.ExpertGrid | None  # this stage's MoE layers (None: no MoE here)
    all_experts: tuple[ExpertId, ...]  # every expert of the model: the index space of cross-rank vectors
    held_names: dict[ExpertId, str]    # the experts this rank holds a shard of, their item names
    held: HeldExperts | None           # ... and their positions in ``order`` (what a header packs)
    token_positions: torch.Tensor      # where this stage's token counts sit among ``all_experts``
    token_replicas: int                # ranks that count the same tokens (summed counts are divided by it)
    replicas: int                      # copies of each snapshot in other nodes' memory
    ep_groups: tuple[tuple[int, ...], ...]  # per EP rank of this stage, the ranks holding its experts
    node_dir: str                      # this node's memory: <shm dir>/<job id>/node<k>
    save_root: str                     # absolute --save ("" when not saving)

    @property
    def order(self) -> ExpertOrder | None:
        """This stage's experts in the layout's order: the order of every per-expert array."""
        return self.expert_layout.order if self.expert_layout else None

    def held_items(self, experts) -> set[str]:
        """The item names of the ``experts`` this rank holds."""
        return {self.held_names[e] for e in experts if e in self.held_names}

    def hello(self, config: PecConfig, storage: str) -> Hello:
        """What this trainer tells its node agent once per connection. ``storage``: the description of the
        job's storage (``Storage.spec``), which the agent rebuilds to persist, commit and retire through."""
        return Hello(self.rank, JobInfo(
            job_id=config.job_id, fingerprint=self.fingerprint, save=self.save_root,
            local_world_size=self.local_world_size, node_rank=self.node_rank, num_nodes=self.num_nodes,
            topology=self.topology, keep=config.keep, replicas=self.replicas, domain=config.failure_domain or "",
            replica_mbps=config.replica_mbps, session=self.session, replica_lag=config.replica_lag,
            host=config.launch.agent_host, storage=storage))

    @classmethod
    def build(cls, config: PecConfig, adapter) -> "JobFacts":
        """Collective: every rank calls it once, with its Megatron adapter."""
        coll = adapter.collectives
        local_world_size = config.launch.local_world_size
        node_rank = config.launch.node_rank
        node_rank = adapter.rank // local_world_size if node_rank is None else node_rank
        num_nodes = adapter.world_size // local_world_size
        every = coll.gather([int(adapter.local_fingerprint[:15], 16), secrets.randbits(48)], 2)
        fingerprint = hashlib.sha256(",".join(str(row[0]) for row in every).encode()).hexdigest()[:16]
        session = f"{every[0][1]:012x}"  # rank 0's
        expert_layout = _expert_layout(adapter)
        all_experts = _all_experts(adapter)
        held_names = {x: item_name(x) for x in adapter.experts_held}
        order = expert_layout.order if expert_layout else None
        first = {x: i for i, x in enumerate(all_experts) if x.expert == 0}  # (list.index: seconds at 58 x 256)
        positions = torch.tensor([first[ExpertId(layer, 0)] + e for layer in adapter.moe_layers
                                  for e in range(adapter.num_experts)], dtype=torch.int64)
        places = coll.gather([adapter.pp_rank, adapter.ep_rank], 2)
        ep_groups = tuple(tuple(r for r, (pp, ep) in enumerate(places) if pp == adapter.pp_rank and ep == e)
                          for e in range(adapter.ep_size))
        return cls(rank=adapter.rank, world_size=adapter.world_size, local_world_size=local_world_size,
                   node_rank=node_rank, num_nodes=num_nodes, topology=adapter.topology, fingerprint=fingerprint,
                   session=session,
                   layout=adapter.layout_record(fingerprint), expert_layout=expert_layout,
                   all_experts=tuple(all_experts), held_names=held_names,
                   held=HeldExperts(adapter.experts_held, order) if order else None, token_positions=positions,
                   token_replicas=adapter.token_replicas,
                   replicas=_replicas(config, num_nodes, adapter.rank), ep_groups=ep_groups,
                   node_dir=node_dir(config.shm_dir, config.job_id, node_rank),
                   save_root=absolute(config.save) if config.save else "")


def _expert_layout(adapter) -> policy.ExpertGrid | None:
    # Same number on every rank: the largest expert footprint of any rank (all experts are equal-sized).
    # Every rank joins the reduction, also a pipeline stage without MoE layers.
    (expert_bytes,) = adapter.collectives.reduce([adapter.expert_bytes()], "max")
    if not adapter.moe_layers:
        return None
    return policy.ExpertGrid(layers=tuple(adapter.moe_layers), num_experts=adapter.num_experts,
                             ep_size=adapter.ep_size, expert_bytes=max(1, expert_bytes))


def _all_experts(adapter) -> list[ExpertId]:
    """Every expert of the model, across pipeline stages (each stage only sees its own layers)."""
    coll = adapter.collectives
    layers = sorted({x for row in coll.gather(adapter.moe_layers, 4096) for x in row if x >= 0})
    (experts,) = coll.reduce([adapter.num_experts], "max")
    return [ExpertId(layer, e) for layer in layers for e in range(experts)]


def _replicas(config: PecConfig, num_nodes: int, rank: int) -> int:
    """Copies of each snapshot in other nodes' memory: --pec-replicas, by default 1 across nodes."""
    wanted = config.replicas
    if num_nodes == 1:
        if wanted:
            log.warning(f"--pec-replicas {wanted} ignored: the job runs on one node, there is no peer to hold "
                        "replicas", rank0=True, once=True)
        return 0
    return min(1 if wanted is None else wanted, num_nodes - 1)

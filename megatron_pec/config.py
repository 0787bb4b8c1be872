"""The ``--pec-*`` flags and the one validated configuration built from Megatron's args - and the
one place the package reads its environment.

Runs on every rank, once, when the engine is first used. ``PecConfig.from_args`` reads the process
environment once: the launcher's facts about this process (``Launch``: torchrun's variables), the
failure domain's default, and a test hook. Outside this module only ``common/faults.py`` (fault
injection, a test hook by design) and the slot files' cgroup check (``MEGATRON_PEC_CGROUP_DIR``, a
test hook) read it; ``tests/test_structure.py`` keeps it so.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass, field
from typing import Mapping

from megatron_pec.format.checkpoint_paths import is_url, storage_spec_for
from megatron_pec.memory.budget import Budget
from megatron_pec.pec.policy import POLICIES

DEFAULT_SHM_DIR = "/dev/shm/megatron_pec"


class PecConfigError(ValueError):
    """A bad flag value or combination; the message names the flag and what to do."""


def add_pec_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--pec-*`` flags; usable as Megatron-LM's ``extra_args_provider``."""
    g = parser.add_argument_group("megatron-pec (partial-experts flash checkpointing)")
    _add_expert_selection(g)
    _add_node_memory(g)
    _add_replicas_storage_and_agent(g)
    return parser


def _add_expert_selection(g) -> None:
    """Which experts a checkpoint saves, and Dynamic-K."""
    g.add_argument("--pec-snapshot-k", type=int, default=None,
                   help="experts per MoE layer copied to node memory at each save "
                        "(default: all experts, a plain flash checkpoint)")
    g.add_argument("--pec-persist-k", type=int, default=None,
                   help="experts per MoE layer the node agent persists to storage, a subset of the "
                        "snapshot set (default: equal to --pec-snapshot-k)")
    g.add_argument("--pec-selection", choices=POLICIES, default="sequential",
                   help="which experts to save: round-robin (sequential), most unsaved tokens first "
                        "with equal capacity per EP rank (load-aware), or a byte budget split by layer "
                        "popularity (popularity). Default: sequential")
    g.add_argument("--pec-budget-mb", type=float, default=None,
                   help="popularity policy: MiB of expert state per checkpoint, summed over all experts "
                        "of all layers and ranks (default: snapshot-K experts per layer)")
    g.add_argument("--pec-dynamic-k", action="store_true",
                   help="after a recovery, double K when the accumulated portion of lost tokens "
                        "exceeds --pec-plt-threshold")
    g.add_argument("--pec-plt-threshold", type=float, default=0.0375,
                   help="PLT limit for --pec-dynamic-k, as a fraction (default 0.0375 = 3.75%%)")


def _add_node_memory(g) -> None:
    """Node memory (where snapshots live, its budget) and how many checkpoints are kept."""
    g.add_argument("--pec-shm-dir", default=DEFAULT_SHM_DIR,
                   help="tmpfs directory for snapshot slots; node memory lives in "
                        "DIR/<job id>/node<node rank>/ (default %(default)s)")
    g.add_argument("--pec-job-id", default=None,
                   help="job id naming the node memory directory (default: torchrun's --rdzv-id "
                        "(TORCHELASTIC_RUN_ID) when set, else one derived from --save, else 'default')")
    g.add_argument("--pec-keep", type=int, default=2,
                   help="persisted iterations to retain; files still referenced for expert versions "
                        "are always kept (default 2; 0 keeps everything)")
    g.add_argument("--pec-wait-for-slot", action="store_true",
                   help="when no snapshot slot is free, wait for one instead of skipping the snapshot "
                        "(persistent saves wait up to 10 s)")
    g.add_argument("--pec-keep-shm", action="store_true",
                   help="keep node-memory slot files when the agent exits")
    g.add_argument("--pec-copy-engine", action="store_true",
                   help="(GPU) copy snapshots to node memory with the GPU's copy engine instead of the checksum "
                        "kernel's launch, which copies on 4 of its cores while it sums; the copy engine makes the "
                        "training step's own small device-to-host copies wait behind a snapshot (default: the "
                        "kernel, where the GPU addresses the page-locked node memory as the host does)")
    g.add_argument("--pec-node-memory", default=None, metavar="BUDGET",
                   help="hard budget for node memory: a multiple of the node's state (e.g. 1.5x) or GiB for "
                        "the node (e.g. 24), its ranks' snapshots and the replicas it keeps of peers included. "
                        "Snapshots take as many experts per layer as it holds (said at start-up). Default: "
                        "two dense states and one spare expert region per expert a snapshot writes (2x the "
                        "state with every expert, less with --pec-snapshot-k)")


def _add_replicas_storage_and_agent(g) -> None:
    """Replicas in peer nodes' memory, the storage (--pec-storage) and the node agent."""
    g.add_argument("--pec-replicas", type=int, default=None,
                   help="copies of every snapshot that node agents keep in other nodes' memory, so a lost "
                        "node restores from a peer instead of storage (default: 1 when the job spans more "
                        "than one node; 0 turns replication off)")
    g.add_argument("--pec-failure-domain", default=None,
                   help="this node's failure domain (e.g. its rack); replicas never go to a node of the same "
                        "domain (default: $MEGATRON_PEC_FAILURE_DOMAIN, else each node is its own domain)")
    g.add_argument("--pec-replica-mbps", type=float, default=None,
                   help="bandwidth cap for sending replicas, MB/s per node agent (default: unlimited)")
    g.add_argument("--pec-replica-lag", type=int, default=2,
                   help="snapshots a node's newest replica on its peers may lag behind its newest snapshot; "
                        "the next snapshot waits for the replica beyond it, so a node loss never loses more "
                        "(default 2)")
    g.add_argument("--pec-storage", default="", metavar="SPEC",
                   help="where --save and --load live: 'posix' (the default: a local or shared file system), "
                        "'<scheme>://...' for a registered storage, or 'package.module:Class' for a class built "
                        "as Class(SPEC); the node agent persists, commits and retires through the same storage")
    g.add_argument("--pec-agent-idle-timeout", type=float, default=600.0,
                   help="seconds the node agent waits for trainers to come back after they vanished "
                        "(default 600)")


def megatron_flag_notes(args) -> list[str]:
    """One line per Megatron checkpoint flag megatron-pec does not follow as Megatron would, and why
    (logged as warnings once when the engine starts). Flags at their defaults say nothing."""
    get = lambda name: getattr(args, name, None)
    notes = []
    if get("no_save_optim"):
        notes.append("--no-save-optim is ignored: megatron-pec always saves the optimizer state (a restore without "
                     "it cannot continue training exactly); use --no-load-optim when loading")
    if get("no_save_rng"):
        notes.append("--no-save-rng is ignored: the RNG state is always saved (it is tiny); use --no-load-rng when "
                     "loading")
    if get("async_save"):
        notes.append("--async-save changes nothing: megatron-pec always saves asynchronously (the node agent persists)")
    if get("ckpt_format") not in (None, "torch_dist"):
        notes.append(f"--ckpt-format {get('ckpt_format')} is ignored: megatron-pec writes its own format "
                     "(safetensors + JSON, see `python -m megatron_pec inspect`)")
    if get("non_persistent_ckpt_type") not in (None, "global"):
        notes.append(f"--non-persistent-ckpt-type {get('non_persistent_ckpt_type')} is ignored: non-persistent saves "
                     "are megatron-pec's node-memory snapshots")
    if get("save_retain_interval"):
        notes.append(f"--save-retain-interval {get('save_retain_interval')} is not honoured yet: retention keeps the "
                     "newest --pec-keep committed iterations; pass --pec-keep 0 to keep every one")
    return notes


def default_job_id(directory: str | None, run_id: str) -> str:
    """The node memory's job id when --pec-job-id is not given.

    torchrun's run id (``run_id``) when the launch named one; its static rendezvous says ``none`` for
    every job, so two jobs sharing a --pec-shm-dir would share node directories: derive the id from the
    checkpoint directory instead (the same on every restart of the job, distinct between jobs)."""
    if run_id and run_id != "none":
        return run_id
    if directory:
        where = directory if is_url(directory) else os.path.realpath(directory)
        return "save-" + hashlib.sha1(where.encode()).hexdigest()[:12]
    return "default"


def flags_markdown() -> str:
    """The --pec-* flags as a markdown table (docs/megatron-lm.md embeds it; a test keeps it current)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in add_pec_args(argparse.ArgumentParser())._actions:
        if action.option_strings and action.option_strings[0].startswith("--pec-"):
            default = "off" if action.const is True else action.default
            if default is None:
                default = "all experts" if action.dest.endswith("_k") else "(see meaning)"
            text = (action.help or "").replace("%%", "%").replace("%(default)s", str(action.default))
            rows.append(f"| `{action.option_strings[0]}` | {default} | {text} |")
    return "\n".join(rows)


@dataclass(frozen=True, slots=True)
class Launch:
    """What the launcher (torchrun) says about this process, read once from its environment."""

    run_id: str = ""
    """TORCHELASTIC_RUN_ID: names the job's node memory unless --pec-job-id does ("none": no name)."""
    local_world_size: int = 1
    """LOCAL_WORLD_SIZE: trainers on this node."""
    local_rank: int = 0
    """LOCAL_RANK: this trainer among them (Megatron trains on that device, modulo the devices seen)."""
    node_rank: int | None = None
    """GROUP_RANK: this node's rank; None: the global rank // LOCAL_WORLD_SIZE."""
    agent_host: str = ""
    """Where peer agents reach this node's agent: MEGATRON_PEC_AGENT_HOST if set; the loopback address
    when MASTER_ADDR is local (simulated nodes on one machine); "": this host's address."""

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> "Launch":
        host = env.get("MEGATRON_PEC_AGENT_HOST") or (
            "127.0.0.1" if env.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost", "::1") else "")
        return cls(run_id=env.get("TORCHELASTIC_RUN_ID", ""), local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                   local_rank=int(env.get("LOCAL_RANK", 0)),
                   node_rank=int(env["GROUP_RANK"]) if env.get("GROUP_RANK") else None, agent_host=host)


def this_launch() -> Launch:
    """The launcher's facts about this process, before Megatron's arguments exist."""
    return Launch.from_environment(os.environ)


@dataclass(frozen=True, slots=True)
class PecConfig:
    save: str | None
    """Megatron's --save: the storage root for persisted checkpoints."""
    load: str | None
    """Megatron's --load."""
    snapshot_k: int | None
    """Experts per layer snapshotted to memory; None = all."""
    persist_k: int | None
    """Experts per layer persisted; None = same as snapshot_k."""
    selection: str
    budget_mb: float | None
    dynamic_k: bool
    plt_threshold: float
    shm_dir: str
    job_id: str
    keep: int
    wait_for_slot: bool
    keep_shm: bool
    agent_idle_timeout: float
    replicas: int | None = None
    """Snapshot copies in other nodes' memory; None = 1 on a multi-node job, else 0."""
    failure_domain: str | None = None
    replica_mbps: float | None = None
    replica_lag: int = 2
    """Snapshots the newest replica may lag behind the newest snapshot before the next one waits."""
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    launch: Launch = field(default_factory=Launch)
    """The launcher's facts about this process (torchrun's environment)."""
    node_memory: Budget | None = None
    """--pec-node-memory: the node's memory budget (None: what the snapshot K needs)."""
    copy_engine: bool = False
    """--pec-copy-engine: (GPU) snapshots copied by the copy engine, never by the checksum kernel."""
    copy_programs: int | None = None
    """Probe hook (MEGATRON_PEC_COPY_PROGRAMS=N): the programs a snapshot's copy by the checksum kernel runs
    on (default ``sum64_kernel.COPY_PROGRAMS``), for measuring the copy's cost to training on a GPU."""
    check_on_device: bool = False
    """Test hook (MEGATRON_PEC_CHECK_ON_DEVICE=1): a restore from node memory checks the items where they
    land, after the copy, on CPU ranks too, as on a GPU."""

    def __post_init__(self):
        for flag, value in (("--pec-snapshot-k", self.snapshot_k), ("--pec-persist-k", self.persist_k)):
            if value is not None and value < 1:
                raise PecConfigError(f"{flag} must be at least 1 (got {value}); omit it to save every expert")
        if self.snapshot_k is not None and self.persist_k is not None and self.persist_k > self.snapshot_k:
            raise PecConfigError(
                f"--pec-persist-k ({self.persist_k}) must not exceed --pec-snapshot-k ({self.snapshot_k}): "
                "persisted experts are a subset of the snapshot")
        if self.selection not in POLICIES:
            raise PecConfigError(f"--pec-selection must be one of {', '.join(POLICIES)} (got {self.selection!r})")
        if not 0.0 < self.plt_threshold < 1.0:
            raise PecConfigError(f"--pec-plt-threshold is a fraction in (0, 1) (got {self.plt_threshold})")
        if self.budget_mb is not None and self.budget_mb <= 0:
            raise PecConfigError(f"--pec-budget-mb must be positive (got {self.budget_mb})")
        if self.keep < 0:
            raise PecConfigError(f"--pec-keep must be >= 0 (got {self.keep})")
        if self.replicas is not None and self.replicas < 0:
            raise PecConfigError(f"--pec-replicas must be >= 0 (got {self.replicas}); 0 turns replication off")
        if self.replica_lag < 1:
            raise PecConfigError(f"--pec-replica-lag must be at least 1 snapshot (got {self.replica_lag})")
        if self.replica_mbps is not None and self.replica_mbps <= 0:
            raise PecConfigError(f"--pec-replica-mbps must be positive (got {self.replica_mbps}); omit it for no cap")
        if self.failure_domain is not None and (not self.failure_domain or "/" in self.failure_domain):
            raise PecConfigError(f"--pec-failure-domain must be a plain non-empty name (got {self.failure_domain!r})")
        if not self.job_id or "/" in self.job_id or self.job_id.startswith("."):
            raise PecConfigError(f"--pec-job-id must be a plain name without '/' (got {self.job_id!r})")

    @staticmethod
    def storage_spec(args) -> str:
        """--pec-storage from Megatron's args; absent, the storage an ``msc://`` --save/--load implies
        (Megatron's --enable-msc paths), else "" (POSIX). Raises ValueError for an ``msc://`` path while
        Megatron's MSC is off (core_v0.19.0 makes it opt-in: --enable-msc; 0.16.1 has it on unless
        --disable-msc), as Megatron itself would not read such a path through MSC."""
        spec = storage_spec_for(getattr(args, "pec_storage", None) or "", getattr(args, "save", None),
                                getattr(args, "load", None))
        if spec.startswith("msc://") and getattr(args, "enable_msc", True) is False:
            raise ValueError(f"--save/--load {spec}/... is an MSC path but Megatron's Multi-Storage Client is off: "
                             "pass --enable-msc (core_v0.19.0 and later; older releases: drop --disable-msc)")
        return spec

    @classmethod
    def from_args(cls, args, env: Mapping[str, str] | None = None) -> "PecConfig":
        """Build from Megatron's args (or the example's); flags absent from ``args`` take their defaults.
        ``env``: the process environment (``os.environ`` unless given)."""
        env = os.environ if env is None else env
        defaults = vars(add_pec_args(argparse.ArgumentParser()).parse_args([]))
        get = lambda name: getattr(args, name, defaults.get(name))
        launch = Launch.from_environment(env)
        job_id = get("pec_job_id") or default_job_id(getattr(args, "save", None) or getattr(args, "load", None),
                                                     launch.run_id)
        return cls(
            save=getattr(args, "save", None), load=getattr(args, "load", None),
            snapshot_k=get("pec_snapshot_k"), persist_k=get("pec_persist_k"), selection=get("pec_selection"),
            budget_mb=get("pec_budget_mb"), dynamic_k=bool(get("pec_dynamic_k")),
            plt_threshold=get("pec_plt_threshold"), shm_dir=get("pec_shm_dir"), job_id=job_id,
            keep=get("pec_keep"), wait_for_slot=bool(get("pec_wait_for_slot")),
            keep_shm=bool(get("pec_keep_shm")), agent_idle_timeout=get("pec_agent_idle_timeout"),
            replicas=get("pec_replicas"),
            failure_domain=get("pec_failure_domain") or env.get("MEGATRON_PEC_FAILURE_DOMAIN") or None,
            replica_mbps=get("pec_replica_mbps"), replica_lag=get("pec_replica_lag"),
            no_load_optim=bool(getattr(args, "no_load_optim", False)),
            no_load_rng=bool(getattr(args, "no_load_rng", False)),
            finetune=bool(getattr(args, "finetune", False)),
            launch=launch, node_memory=_budget(get("pec_node_memory")),
            copy_engine=bool(get("pec_copy_engine")),
            check_on_device=env.get("MEGATRON_PEC_CHECK_ON_DEVICE") == "1",
            copy_programs=int(env["MEGATRON_PEC_COPY_PROGRAMS"]) if env.get("MEGATRON_PEC_COPY_PROGRAMS") else None,
        )


def _budget(text) -> Budget | None:
    try:
        return Budget.parse(text)
    except ValueError as exc:
        raise PecConfigError(str(exc)) from None

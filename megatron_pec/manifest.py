"""Storage layout, commit and validity: node markers, the iteration manifest, the tracker, retention.

Run by the node agents (commit, retention) and read by restore, ``inspect`` and
``verify``. One rule decides validity: an iteration is committed iff its
``manifest.json`` exists. The manifest is written (tmp, fsync, rename) only by
whichever agent sees every node's marker of one save, and the tracker only after it.

Layout under ``--save``::

    iter_0000100/pec/rank_00003.safetensors   one per rank: dense + persisted experts
    iter_0000100/pec/node_0001.json           one per node: its rank files, sizes, checksums
    iter_0000100/pec/manifest.json            the commit marker
    pec_layout/<fingerprint>/rank_00003.json  per configuration: where each stored tensor lies in the model
    latest_checkpointed_iteration.txt         Megatron's tracker

Committed files are never written again. Every save has a generation (the launch's session id, and
what saved: ``<session>`` for the trainers' first save of an iteration, ``<session>.2`` ... for later
ones, ``<session>.exit`` for a planned exit's, ``<session>.resumed`` for a restored iteration the
agent persists from node memory);
a save of an iteration that already has files names its own after its generation
(``rank_00003.<generation>.safetensors``, ``node_0001.<generation>.json``), and only its commit -
the manifest replaced atomically - switches what the iteration holds. The replaced commit's files
go once no manifest references them.
"""

from __future__ import annotations

import fcntl
import os
import re

from megatron_pec import faults
from megatron_pec.items import NON_EXPERT
from megatron_pec.protocol import Manifest, NodeMarker, ProtocolError, RankFile, RankLayout
from megatron_pec.storage import PosixStorage

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_NODE_MARKER = re.compile(r"^node_\d{4}(\.[0-9A-Za-z._-]+)?\.json$")
_RANK_FILE = re.compile(r"^rank_\d{5}(\.[0-9A-Za-z._-]+)?\.safetensors$")
_PARTIAL = re.compile(r"\.tmp(\d+)$")  # a write_atomic that never finished (its agent was killed)


class ManifestError(ValueError):
    """A manifest or marker that is unreadable or inconsistent."""


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def pec_dir(root: str, iteration: int) -> str:
    return os.path.join(iter_dir(root, iteration), "pec")


def rank_file(root: str, iteration: int, rank: int, generation: str | None = None) -> str:
    """The rank file's plain name, or (``generation``) the one a later save of the iteration takes."""
    suffix = f".{generation}" if generation else ""
    return os.path.join(pec_dir(root, iteration), f"rank_{rank:05d}{suffix}.safetensors")


def fresh_rank_file(root: str, iteration: int, rank: int, generation: str, storage=PosixStorage()) -> str:
    """Where a save of ``generation`` writes the rank's file: the plain name unless a file has it
    already (a committed iteration's files are never written again), else named after the save."""
    plain = rank_file(root, iteration, rank)
    return plain if not storage.exists(plain) else rank_file(root, iteration, rank, generation or "again")


def relative(root: str, path: str) -> str:
    return os.path.relpath(path, root)


def layout_path(root: str, fingerprint: str, rank: int) -> str:
    """The ``RankLayout`` of ``rank`` for every iteration saved with configuration ``fingerprint``."""
    return os.path.join(root, "pec_layout", fingerprint, f"rank_{rank:05d}.json")


def node_marker(root: str, iteration: int, node: int, generation: str | None = None) -> str:
    suffix = f".{generation}" if generation else ""
    return os.path.join(pec_dir(root, iteration), f"node_{node:04d}{suffix}.json")


def node_markers(root: str, iteration: int, storage=PosixStorage()) -> list[str]:
    """Every node marker of ``iteration``, of every save."""
    directory = pec_dir(root, iteration)
    return [os.path.join(directory, n) for n in storage.listdir(directory) if _NODE_MARKER.match(n)]


def manifest_path(root: str, iteration: int) -> str:
    return os.path.join(pec_dir(root, iteration), "manifest.json")


def iterations_on_disk(root: str, storage=PosixStorage()) -> list[int]:
    return sorted(int(m.group(1)) for name in storage.listdir(root) if (m := _ITER_DIR.match(name)))


def _read_record(path: str, record, storage):
    try:
        return record.loads(storage.read(path))
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from None
    except ProtocolError as exc:
        raise ManifestError(f"{path}: {exc}") from None


def committed_iterations(root: str, storage=PosixStorage()) -> list[int]:
    """Iterations whose manifest exists, newest first."""
    return [i for i in reversed(iterations_on_disk(root, storage)) if storage.exists(manifest_path(root, i))]


def read_manifest(root: str, iteration: int, storage=PosixStorage()) -> Manifest:
    manifest = _read_record(manifest_path(root, iteration), Manifest, storage)
    if manifest.iteration != iteration:
        raise ManifestError(f"{manifest_path(root, iteration)} names iteration {manifest.iteration}")
    return manifest


def read_tracker(root: str, storage=PosixStorage()) -> str | None:
    try:
        return storage.read(os.path.join(root, TRACKER)).decode().strip()
    except OSError:
        return None


def write_rank_layout(root: str, layout: RankLayout) -> None:
    """Record where rank ``layout.rank``'s tensors lie, once per configuration (by the trainer at
    start-up; outside the agents' fault points). An existing record of the fingerprint is the same."""
    path = layout_path(root, layout.fingerprint, layout.rank)
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(layout.dumps())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_rank_layout(root: str, fingerprint: str, rank: int, storage=PosixStorage()) -> RankLayout:
    path = layout_path(root, fingerprint, rank)
    layout = _read_record(path, RankLayout, storage)
    if (layout.fingerprint, layout.rank) != (fingerprint, rank):
        raise ManifestError(f"{path} describes rank {layout.rank} of configuration {layout.fingerprint}")
    return layout


def write_node_marker(root: str, marker: NodeMarker, storage=PosixStorage()) -> None:
    """This node's part of one save of the iteration: under the plain name unless another save's marker
    has it, else named after its generation."""
    faults.point("before_node_marker", iteration=marker.iteration)
    path = node_marker(root, marker.iteration, marker.node)
    if storage.exists(path) and _generation_of(path, storage) != marker.generation:
        path = node_marker(root, marker.iteration, marker.node, marker.generation or "again")
    storage.write_text_atomic(path, marker.dumps())


def _generation_of(path: str, storage) -> str | None:
    try:
        return _read_record(path, NodeMarker, storage).generation
    except ManifestError:
        return None  # unreadable: never this save's


def try_commit(root: str, iteration: int, num_nodes: int, keep: int, generation: str = "",
               storage=PosixStorage()) -> bool:
    """Commit save ``generation`` of ``iteration`` if every node's marker of it exists: the manifest
    (replacing another save's, atomically: the only switch of what the iteration holds), then the
    tracker; the replaced commit's files go once nothing references them.

    Several agents may race here; each writes identical bytes with an atomic
    rename, and the lock keeps the tracker from moving backwards.
    """
    found = _markers_of(root, iteration, generation, storage)
    if len(found) < num_nodes:
        return False
    with _lock(root):
        replaced = None
        if storage.exists(manifest_path(root, iteration)):
            try:
                replaced = read_manifest(root, iteration, storage)
            except ManifestError:
                replaced = None
            if replaced is not None and replaced.generation == generation:
                return True
        nodes = [found[n] for n in range(num_nodes)]
        ranks: dict[str, RankFile] = {}
        for node in nodes:
            ranks.update(node.ranks)
        if replaced is not None and _files(replaced.ranks) == _files(ranks):
            # every rank's part of this save is the committed file (a persist from node memory that found
            # storage complete): the commit stands as it is; this save's markers go
            for path in node_markers(root, iteration, storage):
                if _generation_of(path, storage) == generation:
                    storage.remove(path)
            return True
        first = nodes[0]
        experts, sources = _expert_versions(root, iteration, ranks, first.fingerprint, storage)
        manifest = Manifest(iteration=iteration, job_id=first.job_id, fingerprint=first.fingerprint,
                            topology=first.topology, num_nodes=num_nodes, world_size=len(ranks), ranks=ranks,
                            experts=experts, sources=sources, generation=generation)
        faults.point("before_manifest", iteration=iteration)
        storage.write_text_atomic(manifest_path(root, iteration), manifest.dumps())
        faults.point("before_tracker", iteration=iteration)
        current = read_tracker(root, storage)
        if current is None or not current.isdigit() or int(current) < iteration:
            storage.write_text_atomic(os.path.join(root, TRACKER), str(iteration))
        if replaced is not None:
            _drop_unreferenced(root, iteration, replaced, storage)
        if keep:
            apply_retention(root, keep, storage)
    return True


def _files(ranks: dict[str, RankFile]) -> dict[str, str]:
    return {rank: entry.file for rank, entry in ranks.items()}


def persisted_nodes(root: str, iteration: int, generation: str, storage=PosixStorage()) -> set[int]:
    """The nodes whose marker of save ``generation`` of ``iteration`` exists."""
    return set(_markers_of(root, iteration, generation, storage))


def _markers_of(root: str, iteration: int, generation: str, storage) -> dict[int, NodeMarker]:
    """node -> its marker of save ``generation`` of ``iteration``."""
    found = {}
    for path in node_markers(root, iteration, storage):
        try:
            marker = _read_record(path, NodeMarker, storage)
        except ManifestError:
            continue  # torn or foreign: never part of this save
        if marker.generation == generation and marker.iteration == iteration:
            found[marker.node] = marker
    return found


def _drop_unreferenced(root: str, iteration: int, replaced: Manifest, storage) -> None:
    """Once another save's commit replaced ``replaced``: its rank files and node markers that no
    committed manifest references any more."""
    referenced = set()
    for i in committed_iterations(root, storage):
        try:
            m = read_manifest(root, i, storage)
        except ManifestError:
            continue
        referenced.update(e.file for e in m.ranks.values())
        referenced.update(e.file for files in m.sources.values() for e in files.values())
    for entry in replaced.ranks.values():
        if entry.file not in referenced:
            storage.remove(os.path.join(root, entry.file))
    for path in node_markers(root, iteration, storage):
        if _generation_of(path, storage) == replaced.generation:
            storage.remove(path)


def retire_after(root: str, iteration: int, storage=PosixStorage()) -> list[int]:
    """De-commit every iteration after ``iteration``, where training resumes and will write them again.

    An abandoned run may have left manifests and node markers there; a stale
    marker would otherwise be combined with the new run's rank files into a
    manifest whose checksums no longer match (and a stale manifest would feed
    the next commit's expert versions). The manifest goes first, then the node
    markers; the tracker moves back to the newest committed iteration <= ``iteration``.
    Half-written files are removed where their writer no longer runs (a killed agent's), and
    in the retired iterations whoever writes them; an agent of this host still persisting an
    earlier iteration while its trainer restarts keeps its file.
    Returns the iterations that lost a manifest or marker. Raises OSError.
    """
    retired = []
    if not storage.exists(root):
        return retired  # nothing saved yet (the first save creates the directory)
    # Looked at without the lock first: usually there is nothing to do, and an agent finishing an
    # older commit (tracker, retention) holds the lock for tens of ms, which every rank would wait.
    if not _retirement(root, iteration, storage) and not _tracker_after(root, iteration, storage):
        return retired
    with _lock(root):
        for i, directory, partial, stale in _retirement(root, iteration, storage):
            for name in partial + stale:
                storage.remove(os.path.join(directory, name))
            if stale:
                storage.fsync_dir(directory)
                retired.append(i)
        if _tracker_after(root, iteration, storage):
            previous = [i for i in committed_iterations(root, storage) if i <= iteration]
            if previous:
                storage.write_text_atomic(os.path.join(root, TRACKER), str(previous[0]))
            else:
                storage.remove(os.path.join(root, TRACKER))
    return retired


def _retirement(root: str, iteration: int, storage) -> list[tuple[int, str, list[str], list[str]]]:
    """(iteration, its directory, half-written files, manifest and node markers to remove) of every
    iteration on disk with something for ``retire_after`` to remove."""
    found = []
    for i in iterations_on_disk(root, storage):
        directory = pec_dir(root, i)
        names = storage.listdir(directory)
        partial = [n for n in names if _PARTIAL.search(n) and (i > iteration or not _writer_alive(n))]
        stale = [n for n in names if n == "manifest.json"] + [n for n in names if _NODE_MARKER.match(n)] \
            if i > iteration else []
        if partial or stale:
            found.append((i, directory, partial, stale))
    return found


def _writer_alive(name: str) -> bool:
    """Whether the process that is writing the half-written file ``name`` (``write_atomic`` names it
    after its pid) still runs on this host: an agent persisting while a trainer restarts. (A writer
    on another node is not seen: its file goes, and its persist fails with an error.)"""
    try:
        os.kill(int(_PARTIAL.search(name).group(1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _tracker_after(root: str, iteration: int, storage) -> bool:
    current = read_tracker(root, storage)
    return current is not None and current.isdigit() and int(current) > iteration


def _expert_versions(root: str, iteration: int, ranks: dict[str, RankFile], fingerprint: str,
                     storage) -> tuple[dict, dict]:
    """Latest persisted version of every expert, merged from the previous committed manifest of the
    same configuration (another layout's files hold other ranges: never referenced).

    Returns (expert item -> iteration, iteration -> rank files of older iterations still referenced).
    """
    older = [i for i in committed_iterations(root, storage) if i < iteration]
    experts, sources = {}, {}
    previous = read_manifest(root, older[0], storage) if older else None
    if previous is not None and previous.fingerprint == fingerprint:
        experts = dict(previous.experts)
        sources = {int(k): v for k, v in previous.sources.items()}
        sources[older[0]] = previous.ranks
    for entry in ranks.values():
        for item in entry.items:
            if item != NON_EXPERT:
                experts[item] = iteration
    needed = set(experts.values()) - {iteration}
    return experts, {str(i): sources[i] for i in sorted(needed) if i in sources}


def apply_retention(root: str, keep: int, storage=PosixStorage()) -> list[int]:
    """Keep the newest ``keep`` committed iterations. An older one whose rank files a retained
    manifest still references for expert versions keeps those files but stops being committed (its
    own references may go); every other older one is deleted. Returns the iterations deleted."""
    committed = committed_iterations(root, storage)
    if len(committed) <= keep:
        return []
    retained = committed[:keep]
    referenced: set[int] = set(retained)
    for i in retained:
        referenced.update(int(k) for k in read_manifest(root, i, storage).sources)
    removed = []
    oldest_retained = retained[-1]
    for i in iterations_on_disk(root, storage):
        if i >= oldest_retained:
            continue
        directory = pec_dir(root, i)
        names = storage.listdir(directory)
        # The manifest goes first: the iteration stops being valid before its files vanish.
        doomed = ["manifest.json"] + [n for n in names if i not in referenced or _NODE_MARKER.match(n)]
        for name in doomed:
            storage.remove(os.path.join(directory, name))
        if i not in referenced:
            storage.remove_empty_dirs(iter_dir(root, i))
            removed.append(i)
    return removed


class _lock:
    """An exclusive lock on ``<root>/.pec.lock`` (serialises commits from agents on one host)."""

    def __init__(self, root: str):
        self.path = os.path.join(root, ".pec.lock")

    def __enter__(self):
        self.f = open(self.path, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()

"""A checkpoint directory (--save, --load): its layout, the commit and validity - node markers, the
iteration manifests, the tracker; retention and retirement through it (``store/retention.py``).

One ``CheckpointDir(root, storage)`` per directory, built where the storage is injected (the engine,
the node agent per job, the command line) and handed to whoever reads or writes the directory; every
byte goes through its ``storage``. The node agents commit and apply retention (save step 6); the
engine retires what an abandoned run left after a restore (load step 7, retire and begin); restore, ``inspect``,
``verify`` and ``export`` read.

One rule decides validity: an iteration is committed iff its ``manifest.json`` exists. The manifest
is committed (``Storage.commit``: atomic, a compare-and-swap on what the committer read) only by whichever
agent sees every node's marker of one save, and the tracker only after it, the same way (it never moves
backwards). Tidying after a commit - the replaced save's files, retention - is not part of it: the
committer may run it later, in another thread (``try_commit(..., defer=)``).

Layout::

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

import os
from typing import Callable

from megatron_pec.common import faults
from megatron_pec.common.errors import ManifestError
from megatron_pec.format.checkpoint_paths import ITER_DIR, MANIFEST, NODE_MARKER, TRACKER, absolute
from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import Manifest, NodeMarker, ProtocolError, RankFile, RankLayout
from megatron_pec.store import retention
from megatron_pec.store.storage import Storage


class CheckpointDir:
    def __init__(self, root: str, storage: Storage):
        self.root = absolute(root)
        self.storage = storage

    def __repr__(self) -> str:
        return f"CheckpointDir({self.root!r})"

    # ---- layout ----------------------------------------------------------------------------------
    def iter_dir(self, iteration: int) -> str:
        return os.path.join(self.root, f"iter_{iteration:07d}")

    def pec_dir(self, iteration: int) -> str:
        return os.path.join(self.iter_dir(iteration), "pec")

    def rank_file(self, iteration: int, rank: int, generation: str | None = None) -> str:
        """The rank file's plain name, or (``generation``) the one a later save of the iteration takes."""
        suffix = f".{generation}" if generation else ""
        return os.path.join(self.pec_dir(iteration), f"rank_{rank:05d}{suffix}.safetensors")

    def fresh_rank_file(self, iteration: int, rank: int, generation: str) -> str:
        """Where a save of ``generation`` writes the rank's file: the plain name unless a file has it
        already (a committed iteration's files are never written again), else named after the save."""
        plain = self.rank_file(iteration, rank)
        return plain if not self.storage.exists(plain) else self.rank_file(iteration, rank, generation or "again")

    def node_marker(self, iteration: int, node: int, generation: str | None = None) -> str:
        suffix = f".{generation}" if generation else ""
        return os.path.join(self.pec_dir(iteration), f"node_{node:04d}{suffix}.json")

    def manifest_path(self, iteration: int) -> str:
        return os.path.join(self.pec_dir(iteration), MANIFEST)

    def layout_path(self, fingerprint: str, rank: int) -> str:
        """The ``RankLayout`` of ``rank`` for every iteration saved with configuration ``fingerprint``."""
        return os.path.join(self.root, "pec_layout", fingerprint, f"rank_{rank:05d}.json")

    @property
    def tracker_path(self) -> str:
        return os.path.join(self.root, TRACKER)

    def path(self, relative: str) -> str:
        """A path the records hold relative to the directory (``RankFile.file``), made whole."""
        return os.path.join(self.root, relative)

    def relative(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    # ---- reading ---------------------------------------------------------------------------------
    def iterations_on_disk(self) -> list[int]:
        return sorted(int(m.group(1)) for name in self.storage.list(self.root) if (m := ITER_DIR.match(name)))

    def committed_iterations(self) -> list[int]:
        """Iterations whose manifest exists, newest first."""
        return [i for i in reversed(self.iterations_on_disk()) if self.is_committed(i)]

    def is_committed(self, iteration: int) -> bool:
        return self.storage.exists(self.manifest_path(iteration))

    def read_manifest(self, iteration: int) -> Manifest:
        manifest = self._read_record(self.manifest_path(iteration), Manifest)
        if manifest.iteration != iteration:
            raise ManifestError(f"{self.manifest_path(iteration)} names iteration {manifest.iteration}")
        return manifest

    def references(self, iteration: int, ranks: dict[str, RankFile]) -> bool:
        """Whether ``iteration``'s commit references exactly ``ranks``' files, every rank's (False: not committed
        or unreadable)."""
        try:
            return _files(self.read_manifest(iteration).ranks) == _files(ranks)
        except ManifestError:
            return False

    def read_tracker(self) -> str | None:
        try:
            return self.storage.read(self.tracker_path).decode().strip()
        except OSError:
            return None

    def node_markers(self, iteration: int) -> list[str]:
        """Every node marker of ``iteration``, of every save."""
        directory = self.pec_dir(iteration)
        return [os.path.join(directory, n) for n in self.storage.list(directory) if NODE_MARKER.match(n)]

    def persisted_nodes(self, iteration: int, generation: str) -> set[int]:
        """The nodes whose marker of save ``generation`` of ``iteration`` exists."""
        return set(self._markers_of(iteration, generation))

    def read_rank_layout(self, fingerprint: str, rank: int) -> RankLayout:
        path = self.layout_path(fingerprint, rank)
        layout = self._read_record(path, RankLayout)
        if (layout.fingerprint, layout.rank) != (fingerprint, rank):
            raise ManifestError(f"{path} describes rank {layout.rank} of configuration {layout.fingerprint}")
        return layout

    def megatron_format(self) -> str | None:
        """What the directory holds when it is a checkpoint of Megatron's own formats and not megatron-pec's
        (``"Megatron's torch_dist checkpoint of iteration 4"``), else None."""
        if self.committed_iterations():
            return None
        for i in reversed(self.iterations_on_disk()):
            names = self.storage.list(self.iter_dir(i))
            if names and "pec" not in names:
                fmt = ("torch_dist" if "metadata.json" in names or ".metadata" in names
                       else "torch" if any(n.startswith("mp_rank_") for n in names) else "unknown-format")
                return f"Megatron's {fmt} checkpoint of iteration {i}"
        return None

    def _read_record(self, path: str, record):
        try:
            return record.loads(self.storage.read(path))
        except OSError as exc:
            raise ManifestError(f"cannot read {path}: {exc}") from None
        except ProtocolError as exc:
            raise ManifestError(f"{path}: {exc}") from None

    def generation_of(self, path: str) -> str | None:
        """The save generation a node marker belongs to (None: unreadable, never this save's)."""
        try:
            return self._read_record(path, NodeMarker).generation
        except ManifestError:
            return None  # unreadable: never this save's

    def _markers_of(self, iteration: int, generation: str) -> dict[int, NodeMarker]:
        """node -> its marker of save ``generation`` of ``iteration``."""
        found = {}
        for path in self.node_markers(iteration):
            try:
                marker = self._read_record(path, NodeMarker)
            except ManifestError:
                continue  # torn or foreign: never part of this save
            if marker.generation == generation and marker.iteration == iteration:
                found[marker.node] = marker
        return found

    # ---- writing: the trainer's layout record, the agents' markers and commits -----------------------
    def write_rank_layout(self, layout: RankLayout) -> None:
        """Record where rank ``layout.rank``'s tensors lie, once per configuration (by the trainer at
        start-up). An existing record of the fingerprint is the same."""
        self.storage.create(self.layout_path(layout.fingerprint, layout.rank), layout.dumps().encode())

    def write_node_marker(self, marker: NodeMarker) -> None:
        """This node's part of one save of the iteration: under the plain name unless another save's marker
        has it, else named after its generation."""
        faults.point("before_node_marker", iteration=marker.iteration)
        path = self.node_marker(marker.iteration, marker.node)
        if self.storage.exists(path) and self.generation_of(path) != marker.generation:
            path = self.node_marker(marker.iteration, marker.node, marker.generation or "again")
        self.storage.write(path, [marker.dumps().encode()])

    def try_commit(self, iteration: int, num_nodes: int, keep: int, generation: str = "",
                   defer: Callable[[Callable[[], None]], None] | None = None) -> bool:
        """Commit save ``generation`` of ``iteration`` if every node's marker of it exists: the manifest
        (replacing another save's, atomically: the only switch of what the iteration holds), then the
        tracker. Then the tidying: the replaced commit's files go once nothing references them, and
        retention keeps ``keep`` iterations - run here, or handed to ``defer`` (a purge thread's queue)
        to run off the commit's path. Raises OSError.

        Several agents may race here: each commit is a compare-and-swap on the manifest it read, so a
        loser re-reads and finds the winner's (the same save's: done) or commits over another save's.
        """
        found = self._markers_of(iteration, generation)
        if len(found) < num_nodes:
            return False
        storage, path = self.storage, self.manifest_path(iteration)
        for _ in range(16):  # (each lost race means another agent committed: a few at most)
            try:
                current = storage.read(path)
            except FileNotFoundError:
                current = None
            replaced = None
            if current is not None:
                try:
                    replaced = Manifest.loads(current)
                except ProtocolError:
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
                for marker in self.node_markers(iteration):
                    if self.generation_of(marker) == generation:
                        storage.delete(marker)
                return True
            first = nodes[0]
            experts, sources = self._expert_versions(iteration, ranks, first.fingerprint)
            manifest = Manifest(iteration=iteration, job_id=first.job_id, fingerprint=first.fingerprint,
                                topology=first.topology, num_nodes=num_nodes, world_size=len(ranks), ranks=ranks,
                                experts=experts, sources=sources, generation=generation)
            faults.point("before_manifest", iteration=iteration)
            if storage.commit(path, manifest.dumps().encode(), expected=current):
                break
        else:
            raise OSError(f"{path}: other commits kept replacing it")
        faults.point("before_tracker", iteration=iteration)
        self._advance_tracker(iteration)
        tidy = lambda: self._tidy(iteration, replaced, keep)
        if defer is not None:
            defer(tidy)
        else:
            tidy()
        return True

    def _advance_tracker(self, iteration: int) -> None:
        """The tracker names ``iteration`` unless it names a newer one (a compare-and-swap: never backwards)."""
        for _ in range(16):
            try:
                current = self.storage.read(self.tracker_path)
            except FileNotFoundError:
                current = None
            text = current.decode(errors="replace").strip() if current is not None else ""
            if text.isdigit() and int(text) >= iteration:
                return
            if self.storage.commit(self.tracker_path, str(iteration).encode(), expected=current):
                return
        raise OSError(f"{self.tracker_path}: other commits kept replacing it")

    def _tidy(self, iteration: int, replaced: Manifest | None, keep: int) -> None:
        if replaced is not None:
            retention.drop_unreferenced(self, iteration, replaced)
        if keep:
            self.apply_retention(keep)

    def _expert_versions(self, iteration: int, ranks: dict[str, RankFile], fingerprint: str) -> tuple[dict, dict]:
        """Latest persisted version of every expert, merged from the previous committed manifest of the
        same configuration (another layout's files hold other ranges: never referenced).

        Returns (expert item -> iteration, iteration -> rank files of older iterations still referenced).
        """
        older = [i for i in self.committed_iterations() if i < iteration]
        experts, sources = {}, {}
        previous = self.read_manifest(older[0]) if older else None
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

    # ---- retention and retirement ----------------------------------------------------------------------
    def apply_retention(self, keep: int) -> list[int]:
        """``retention.apply_retention``: keep the newest ``keep`` committed iterations."""
        return retention.apply_retention(self, keep)

    def retire_after(self, iteration: int) -> list[int]:
        """``retention.retire_after``: de-commit every iteration after ``iteration``. Raises OSError."""
        return retention.retire_after(self, iteration)



def _files(ranks: dict[str, RankFile]) -> dict[str, str]:
    return {rank: entry.file for rank, entry in ranks.items()}


__all__ = ["CheckpointDir", "ManifestError", "TRACKER", "MANIFEST"]

"""A checkpoint directory (--save, --load): its layout, the commit and validity - node markers, the
iteration manifests, the tracker, retention and retirement.

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
import re
from typing import Callable

from megatron_pec.common import faults
from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import Manifest, NodeMarker, ProtocolError, RankFile, RankLayout
from megatron_pec.format.checkpoint_paths import absolute
from megatron_pec.store.storage import Storage

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_NODE_MARKER = re.compile(r"^node_\d{4}(\.[0-9A-Za-z._-]+)?\.json$")


class ManifestError(ValueError):
    """A manifest or marker that is unreadable or inconsistent."""


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
        return sorted(int(m.group(1)) for name in self.storage.list(self.root) if (m := _ITER_DIR.match(name)))

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

    def read_tracker(self) -> str | None:
        try:
            return self.storage.read(self.tracker_path).decode().strip()
        except OSError:
            return None

    def node_markers(self, iteration: int) -> list[str]:
        """Every node marker of ``iteration``, of every save."""
        directory = self.pec_dir(iteration)
        return [os.path.join(directory, n) for n in self.storage.list(directory) if _NODE_MARKER.match(n)]

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

    def _generation_of(self, path: str) -> str | None:
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
        if self.storage.exists(path) and self._generation_of(path) != marker.generation:
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
                    if self._generation_of(marker) == generation:
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
        tidy = lambda: self._tidy(iteration, replaced, keep)  # noqa: E731
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
            self._drop_unreferenced(iteration, replaced)
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

    def _drop_unreferenced(self, iteration: int, replaced: Manifest) -> None:
        """Once another save's commit replaced ``replaced``: its rank files and node markers that no
        committed manifest references any more."""
        referenced = set()
        for i in self.committed_iterations():
            try:
                m = self.read_manifest(i)
            except ManifestError:
                continue
            referenced.update(e.file for e in m.ranks.values())
            referenced.update(e.file for files in m.sources.values() for e in files.values())
        for entry in replaced.ranks.values():
            if entry.file not in referenced:
                self.storage.delete(self.path(entry.file))
        for path in self.node_markers(iteration):
            if self._generation_of(path) == replaced.generation:
                self.storage.delete(path)

    # ---- retention and retirement ----------------------------------------------------------------------
    def apply_retention(self, keep: int) -> list[int]:
        """Keep the newest ``keep`` committed iterations. An older one whose rank files a retained
        manifest still references for expert versions keeps those files but stops being committed (its
        own references may go); every other older one is deleted. Returns the iterations deleted."""
        committed = self.committed_iterations()
        if len(committed) <= keep:
            return []
        retained = committed[:keep]
        referenced: set[int] = set(retained)
        for i in retained:
            referenced.update(int(k) for k in self.read_manifest(i).sources)
        removed = []
        oldest_retained = retained[-1]
        for i in self.iterations_on_disk():
            if i >= oldest_retained:
                continue
            directory = self.pec_dir(i)
            names = self.storage.list(directory)
            # The manifest goes first: the iteration stops being valid before its files vanish.
            doomed = [MANIFEST] + [n for n in names if i not in referenced or _NODE_MARKER.match(n)]
            for name in doomed:
                self.storage.delete(os.path.join(directory, name))
            if i not in referenced:
                self.storage.delete_prefix(directory)  # what is left there: partial writes
                if not self.storage.list(self.iter_dir(i)):  # (anything else in the iteration stays)
                    self.storage.delete_prefix(self.iter_dir(i))
                removed.append(i)
        return removed

    def retire_after(self, iteration: int) -> list[int]:
        """De-commit every iteration after ``iteration``, where training resumes and will write them again.

        An abandoned run may have left manifests and node markers there; a stale
        marker would otherwise be combined with the new run's rank files into a
        manifest whose checksums no longer match (and a stale manifest would feed
        the next commit's expert versions). The manifest goes first, then the node
        markers; the tracker moves back to the newest committed iteration <= ``iteration``.
        Partial writes are discarded where their writer is gone (a killed agent's: the storage
        tells), and in the retired iterations whoever writes them; an agent of this host still
        persisting an earlier iteration while its trainer restarts keeps its file.
        Returns the iterations that lost a manifest or marker. Raises OSError.
        """
        retired = []
        if not self.storage.exists(self.root):
            return retired  # nothing saved yet (the first save creates the directory)
        for i in self.iterations_on_disk():
            directory = self.pec_dir(i)
            self.storage.discard_partial(directory, live_too=i > iteration)
            if i > iteration:
                names = self.storage.list(directory)
                stale = [n for n in names if n == MANIFEST] + [n for n in names if _NODE_MARKER.match(n)]
                for name in stale:
                    self.storage.delete(os.path.join(directory, name))
                if stale:
                    retired.append(i)
        for _ in range(16):
            try:
                current = self.storage.read(self.tracker_path)
            except FileNotFoundError:
                return retired
            text = current.decode(errors="replace").strip()
            if not text.isdigit() or int(text) <= iteration:
                return retired
            previous = [i for i in self.committed_iterations() if i <= iteration]
            if not previous:
                self.storage.delete(self.tracker_path)
                return retired
            if self.storage.commit(self.tracker_path, str(previous[0]).encode(), expected=current):
                return retired
        raise OSError(f"{self.tracker_path}: other commits kept replacing it")


def _files(ranks: dict[str, RankFile]) -> dict[str, str]:
    return {rank: entry.file for rank, entry in ranks.items()}


__all__ = ["CheckpointDir", "ManifestError", "TRACKER", "MANIFEST"]

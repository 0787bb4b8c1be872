"""Reading a committed iteration by its manifest: the rank files it references, each header checked
once against the manifest's entry, and every item a reader takes verified before any byte is used.

Shared by the readers that place bytes by the layout records instead of by rank (``export``,
``reshard``); storage only, no process group. Errors are raised as the caller's exception type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import Manifest, ProtocolError, RankFile, SlotHeader
from megatron_pec.format.stformat import Header
from megatron_pec.restore.sources import SourceError, read_checked_header, verify_items
from megatron_pec.store.checkpoint_dir import CheckpointDir


@dataclass
class CommittedFile:
    """A committed rank file and the items a reader takes from it."""

    entry: RankFile
    path: str
    header: Header
    by_name: dict = field(default_factory=dict)   # tensor name -> its entry in ``header``
    items: set[str] = field(default_factory=set)

    @property
    def version(self) -> int:
        return int(self.header.metadata.get("iteration", -1))


class CommittedFiles:
    def __init__(self, directory: CheckpointDir, m: Manifest, error=SourceError):
        self.directory, self.m, self.error = directory, m, error
        self.files: dict[tuple[int, int], CommittedFile] = {}  # (version, rank) -> its file

    def holding(self, item: str, rank: int) -> CommittedFile:
        """The file of ``rank`` holding ``item`` at the version the manifest names (the iteration for the
        dense state); the item is recorded as taken from it (``verify``)."""
        version = self.m.iteration if item == NON_EXPERT else self.m.experts.get(item)
        entry = self.m.file_of(version, rank) if version is not None else None
        if entry is None or item not in entry.items:
            raise self.error(f"iteration {self.m.iteration}: no committed file of rank {rank} holds {item}"
                             + (f" at version {version}" if version is not None else ""))
        key = (version, rank)
        if key not in self.files:
            path = self.directory.path(entry.file)
            header = self._header(path, entry)
            self.files[key] = CommittedFile(entry, path, header, {e.name: e for e in header.tensors})
        self.files[key].items.add(item)
        return self.files[key]

    def verify(self) -> None:
        """Every item taken so far, streamed and checked against the manifest's per-item checksums."""
        for file in self.files.values():
            try:
                verify_items(file.path, file.header, file.items, file.entry.item_checks, self.directory.storage)
            except SourceError as exc:
                raise self.error(str(exc)) from None

    def headers(self, version: int) -> dict[int, SlotHeader]:
        """Rank -> the decoded header of its file written at ``version`` (the iteration or an older one
        the manifest still references)."""
        files = self.m.ranks if version == self.m.iteration else self.m.sources.get(str(version), {})
        out = {}
        for rank, entry in files.items():
            path = self.directory.path(entry.file)
            try:
                out[int(rank)] = SlotHeader.from_metadata(self._header(path, entry).metadata)
            except ProtocolError as exc:
                raise self.error(f"{path}: {exc}") from None
        return out

    def _header(self, path: str, entry: RankFile) -> Header:
        try:
            return read_checked_header(path, entry, self.directory.storage)
        except SourceError as exc:
            raise self.error(str(exc)) from None


__all__ = ["CommittedFile", "CommittedFiles"]

"""``inspect`` and ``verify``: read a checkpoint directory without torch or Megatron.

``inspect`` summarises iterations (committed or not), bytes per rank, expert
versions, PLT and K; ``verify`` re-reads every file a committed manifest
references and checks size and crc32 (and the header crc32 and per-item checksums that
partial restores rely on).
"""

from __future__ import annotations

import json

from megatron_pec.format.protocol import ProtocolError, SlotHeader
from megatron_pec.format.stformat import FormatError, read_header
from megatron_pec.restore.sources import SourceError, read_rank_file
from megatron_pec.store.checkpoint_dir import CheckpointDir, ManifestError
from megatron_pec.store.storage import Storage


def _read_header(path: str, storage: Storage) -> SlotHeader:
    _, layout = read_header(lambda offset, n: storage.read_range(path, offset, n), storage.size(path))
    return SlotHeader.from_metadata(layout.metadata)


def inspect(directory: CheckpointDir) -> dict:
    committed = set(directory.committed_iterations())
    report = {"root": directory.root, "tracker": directory.read_tracker(), "iterations": []}
    kept_for: dict[int, list[int]] = {}  # older iteration -> committed ones that read expert versions from it
    for i in directory.iterations_on_disk():
        entry = {"iteration": i, "committed": i in committed}
        if i in committed:
            m = directory.read_manifest(i)
            entry.update(topology=m.topology, world_size=m.world_size, num_nodes=m.num_nodes,
                         bytes_per_rank={r: e.size for r, e in sorted(m.ranks.items(), key=lambda t: int(t[0]))},
                         experts_saved=sorted({x for e in m.ranks.values() for x in e.items if x != "dense"}),
                         expert_versions=m.experts, referenced_iterations=sorted(int(k) for k in m.sources))
            for k in m.sources:
                kept_for.setdefault(int(k), []).append(i)
            first = directory.path(m.ranks[min(m.ranks, key=int)].file)
            try:
                pec = json.loads(_read_header(first, directory.storage).pec)
                entry.update(plt=pec.get("plt"), lost_tokens=pec.get("lost_tokens"),
                             snapshot_k=pec.get("snapshot", {}).get("k"), persist_k=pec.get("persist", {}).get("k"),
                             recoveries=pec.get("recoveries"))
            except (OSError, FormatError, ProtocolError, ValueError) as exc:
                entry["error"] = f"cannot read {first}: {exc}"
        else:
            entry["files"] = directory.storage.list(directory.pec_dir(i))
        report["iterations"].append(entry)
    for entry in report["iterations"]:
        if not entry["committed"] and entry["iteration"] in kept_for:
            entry["kept_for"] = sorted(kept_for[entry["iteration"]])
    return report


def format_inspect(report: dict) -> str:
    lines = [f"checkpoint directory {report['root']}  (tracker: {report['tracker']})"]
    for it in report["iterations"]:
        if it.get("kept_for"):
            lines.append(f"  iteration {it['iteration']:>7}: files kept for the expert versions of iteration(s) "
                         f"{', '.join(map(str, it['kept_for']))} (not a restore point)")
            continue
        if not it["committed"]:
            files = ", ".join(it["files"]) or "empty"
            lines.append(f"  iteration {it['iteration']:>7}: NOT committed (partial: {files})")
            continue
        sizes = it["bytes_per_rank"]
        lines.append(f"  iteration {it['iteration']:>7}: committed, {it['world_size']} ranks on {it['num_nodes']} "
                     f"node(s), topology {it['topology']}")
        lines.append("      bytes per rank: " + ", ".join(f"r{r}={n / 2**20:.2f} MiB" for r, n in sizes.items()))
        if it.get("snapshot_k") is not None:
            lines.append(f"      K snapshot/persist: {it['snapshot_k']}/{it['persist_k']}, PLT so far "
                         f"{(it['plt'] or 0):.3%} after {it['recoveries']} recoveries")
        if it["expert_versions"]:
            by_version: dict[int, list[str]] = {}
            for x, v in it["expert_versions"].items():
                by_version.setdefault(v, []).append(x)
            for v in sorted(by_version, reverse=True):
                lines.append(f"      experts at version {v}: {' '.join(sorted(by_version[v]))}")
    return "\n".join(lines)


def verify(directory: CheckpointDir, iteration: int | None = None) -> list[str]:
    """Problems found (empty = sound) in the committed iterations (or just ``iteration``)."""
    problems = []
    committed = directory.committed_iterations()
    if iteration is not None:
        if iteration not in committed:
            return [f"iteration {iteration} is not committed under {directory.root}"]
        committed = [iteration]
    if not committed:
        return [f"no committed megatron-pec checkpoint under {directory.root}"]
    for i in committed:
        try:
            m = directory.read_manifest(i)
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        files = [(i, e) for e in m.ranks.values()]
        files += [(int(v), e) for v, ranks in m.sources.items() for e in ranks.values()]
        for version, entry in files:
            path = directory.path(entry.file)
            try:
                read_rank_file(path, entry, directory.storage, deep=True)
            except SourceError as exc:
                problems.append(f"iteration {i} (file of {version}): {exc}")
            except OSError as exc:
                problems.append(f"iteration {i} (file of {version}): {path}: {exc.strerror or exc}")
    return problems

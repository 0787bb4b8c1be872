"""Agent phase 5, carry forward: copy into a new slot the experts its snapshot did not write.

A PEC snapshot writes only K experts per layer. Left alone, node memory would
hold just the experts of the last three snapshots, and a restart would read all
the others from older persisted versions (more lost tokens), or from nowhere
before the first commit. So once a snapshot is complete, the agent copies each
expert it did not write from the previous snapshot's slot (its "base", where
that expert was written or itself carried), and every complete slot holds every
expert at its latest version. This runs off the training path; the trainer
leaves the base slot alone until the agent releases the new one.
"""

from __future__ import annotations

import json

from megatron_pec.agent.persist import item_checksums
from megatron_pec.slots import open_slot


def carry_forward(path: str, record: dict, base_path: str, base_record: dict, wanted: dict[str, int]) -> None:
    """Copy the ``wanted`` items (name -> version the trainer expects) from the base slot into
    the slot at ``path`` and add them to its ``record`` (items, crcs, and their cumulative token
    counts at that version, which a restore needs to account the lost tokens).

    An item is copied only if the base holds exactly that version, for the same job,
    configuration and --save. Raises OSError or FormatError.
    """
    take = {i: v for i, v in wanted.items() if base_record["items"].get(i) == v}
    if not take:
        return
    mapping, header = open_slot(path)
    base_map, base_header = open_slot(base_path)
    try:
        meta = base_header.metadata
        if meta.get("state") != "complete" or meta.get("iteration") != str(base_record["iteration"]):
            return  # the base was rewritten since the agent recorded it: carry nothing
        if any(meta.get(k) != header.metadata.get(k) for k in ("job_id", "fingerprint", "save")):
            return  # a slot left by another run (other job, configuration or --save)
        source = {e.name: e for e in base_header.tensors}
        copies = []
        for e in header.tensors:
            if e.item in take:
                b = source.get(e.name)
                if b is None or b.end - b.begin != e.end - e.begin:
                    return  # another layout: never mix bytes of different tensors
                copies.append((header.data_start + e.begin, base_header.data_start + b.begin, e.end - e.begin))
        dst, src = memoryview(mapping), memoryview(base_map)
        try:
            for to, frm, n in copies:
                dst[to:to + n] = src[frm:frm + n]
        finally:
            dst.release()
            src.release()
        at_base, carried_tokens = json.loads(meta["tokens"]), base_record.get("tokens", {})
        record["items"].update(take)
        record["crcs"].update(item_checksums(mapping, header, set(take)))
        record["tokens"].update({i: carried_tokens[i] if i in carried_tokens else at_base.get(i, 0) for i in take})
    finally:
        base_map.close()
        mapping.close()

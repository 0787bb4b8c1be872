"""What a node's memory holds and takes: ``python -m megatron_pec inspect <shm dir>/<job id>/node<k>``.

Per rank: the files (home slots, expert pool) and their bytes against the rank's state, the plan its
trainer made (``rank<r>.memory.json``: budget, snapshot K asked and held), and the newest snapshot the
agent's index records; the replicas the node keeps of peer nodes; the node's total against its state.
Reads files only (no agent, no torch).
"""

from __future__ import annotations

import json
import os

from megatron_pec.memory.history import INDEX, NO_HOME, NodeMemory
from megatron_pec.memory.node_files import RANK_FILE, REPLICAS, memory_sizing_name


def is_node_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, INDEX)) or any(RANK_FILE.fullmatch(name) for name in os.listdir(path))


def report(node_dir: str) -> dict:
    names = sorted(os.listdir(node_dir))
    memory = NodeMemory.read(node_dir)
    ranks = sorted({int(m.group(1)) for n in names if (m := RANK_FILE.fullmatch(n))})
    out = {"node_dir": node_dir, "ranks": {}}
    for rank in ranks:
        files = {n: os.path.getsize(os.path.join(node_dir, n)) for n in names
                 if (m := RANK_FILE.fullmatch(n)) and int(m.group(1)) == rank}
        plan = _json(os.path.join(node_dir, memory_sizing_name(rank)))
        homes = [(r.iteration, s) for s, r in memory.slots.get(rank, {}).items() if r.iteration != NO_HOME]
        recorded = {item for r in memory.slots.get(rank, {}).values() for item in r.items}
        out["ranks"][str(rank)] = {"files": files, "bytes": sum(files.values()), "plan": plan,
                                   "newest_snapshot": max(homes)[0] if homes else None,
                                   "items_recorded": len(recorded)}
    replicas = os.path.join(node_dir, REPLICAS)
    held = {n: os.path.getsize(os.path.join(replicas, n)) for n in sorted(os.listdir(replicas))
            if n.endswith(".replica")} if os.path.isdir(replicas) else {}
    index = _json(os.path.join(replicas, "index.json")) or {}
    out["replicas"] = {"files": held, "bytes": sum(held.values()),
                       "iterations": {k: e.get("record", {}).get("iteration")
                                      for k, e in index.get("entries", {}).items()}}
    state = sum((r["plan"] or {}).get("state_bytes", 0) for r in out["ranks"].values())
    own = sum(r["bytes"] for r in out["ranks"].values())
    out["node"] = {"own_bytes": own, "replica_bytes": out["replicas"]["bytes"], "state_bytes": state,
                   "ratio": round((own + out["replicas"]["bytes"]) / state, 4) if state else None}
    return out


def format_report(r: dict) -> str:
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    lines = [f"node memory {r['node_dir']}"]
    for rank, x in r["ranks"].items():
        plan = x["plan"] or {}
        state = plan.get("state_bytes")
        ratio = f" ({x['bytes'] / state:.2f}x its state of {mib(state)})" if state else ""
        k = plan.get("snapshot_k")
        held = "" if k is None else f", snapshot-K {k}" + (f" of the asked {plan['asked_k']}"
                                                          if k < plan.get("asked_k", k) else "")
        budget = f", budget {plan['budget']}" if plan.get("budget") else ""
        lines.append(f"  rank {rank}: {mib(x['bytes'])}{ratio}: {plan.get('homes', '?')} home slots, "
                     f"{plan.get('regions', '?')} expert regions for {plan.get('experts', '?')} experts{held}{budget}; "
                     f"newest snapshot {x['newest_snapshot']}, {x['items_recorded']} items recorded")
    rep = r["replicas"]
    if rep["files"]:
        lines.append(f"  replicas of peers: {mib(rep['bytes'])} in {len(rep['files'])} file(s), at "
                     + ", ".join(f"node.rank {k}: {v}" for k, v in sorted(rep["iterations"].items())))
    node = r["node"]
    total = node["own_bytes"] + node["replica_bytes"]
    lines.append(f"  node: {mib(total)}" + (f" = {node['ratio']:.2f}x its state of {mib(node['state_bytes'])}"
                                              if node["ratio"] else ""))
    return "\n".join(lines)


def _json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


__all__ = ["is_node_dir", "report", "format_report"]

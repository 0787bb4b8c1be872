"""The issues' targets for the checkpoint benchmark (``benchmarks.checkpoint``), evaluated on one run's
numbers: one line per target, saying the measured value, the target and whether it was met."""

from __future__ import annotations

from benchmarks import report


def evaluate(result: dict) -> list[str]:
    """The issues' targets, evaluated on the measured numbers."""
    out = []
    run = result["runs"][-1]
    ms, fl = run["methods"], run["floors"]
    td = ms.get("torch_dist sync", {}).get("blocking_s_median")
    for name, m in ms.items():
        if m["family"] != "pec" or not m.get("blocking_s_median"):
            continue
        floor = m.get("memcpy_floor_s")
        ratio = m["blocking_s_median"] / floor if floor else None
        text = f"{name}: blocking {m['blocking_s_median'] * 1000:.1f} ms = {ratio:.1f}× the memcpy floor of its " \
               f"{m['snapshot_bytes_per_rank'] / 1e6:.0f} MB/rank ({floor * 1000:.1f} ms) - target ≤ 1.5×: " \
               f"{'met' if ratio <= 1.5 else 'NOT met'}"
        if td:
            text += f"; torch_dist sync is {td / m['blocking_s_median']:.1f}× slower (target ≥ 5×: " \
                    f"{'met' if td / m['blocking_s_median'] >= 5 else 'NOT met'})"
        out.append(text)
    out += restore_and_throughput_targets(ms, fl)
    out += host_path_and_restore_targets(ms)
    full = ms.get("megatron-pec K=all")
    if full and full.get("persist_MBps"):
        pct = full["persist_MBps"] / fl["write_MBps"]
        out.append(f"megatron-pec K=all persist {full['persist_MBps']:.0f} MB/s = {pct:.0%} of the one-writer "
                   f"write+fsync floor {fl['write_MBps']:.0f} MB/s "
                   f"(target ≥ 80%: {'met' if pct >= 0.8 else 'NOT met'})")
    eight = None
    for p in (result.get("scaling") or {}).get("points", []):
        if p["num_experts"] == 8:
            eight = 1 - p["K=1"]["bytes_per_rank"] / p["full"]["bytes_per_rank"]
            out.append(f"8 experts (scaling run): K=1 persists {p['K=1']['bytes_per_rank'] / 1e6:.1f} MB/rank vs "
                       f"{p['full']['bytes_per_rank'] / 1e6:.1f} MB/rank full = {eight:.0%} smaller "
                       f"(target ≥ 70%: {'met' if eight >= 0.7 else 'NOT met'})")
    for r in result["runs"]:
        methods = r["methods"]
        if r["model"]["num_experts"] == 8 and "megatron-pec K=1" in methods and "megatron-pec K=all" in methods:
            k1, fa = methods["megatron-pec K=1"]["bytes_per_rank"], methods["megatron-pec K=all"]["bytes_per_rank"]
            red = 1 - k1 / fa
            out.append(f"8 experts, hidden {r['model']['hidden_size']}: K=1 persists {k1 / 1e6:.1f} MB/rank vs "
                       f"{fa / 1e6:.1f} MB/rank full = {red:.0%} smaller "
                       f"(target ≥ 70%: {'met' if red >= 0.7 else 'NOT met'})")
    return out


def restore_and_throughput_targets(ms: dict, fl: dict) -> list[str]:
    """The goals: restores at every K against the memcpy floor and DLRover, the save's floor,
    throughput against DLRover."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out, dl = [], ms.get("DLRover flash ckpt", {})
    full = ms.get("megatron-pec K=all", {})
    for name, m in ms.items():
        if m["family"] != "pec":
            continue
        memory, storage = m.get("restore_memory_s"), m.get("restore_storage_s")
        if memory:
            ratio = memory / report.restore_floor(fl)
            text = f"{name}: restore from memory {memory * 1000:.0f} ms = {ratio:.1f}× the memcpy floor " \
                   f"(target ≤ 1.5×: {verdict(ratio <= 1.5)})"
            if dl.get("restore_memory_s"):
                text += f"; DLRover {dl['restore_memory_s'] * 1000:.0f} ms (target faster: " \
                        f"{verdict(memory < dl['restore_memory_s'])})"
            if name != "megatron-pec K=all" and full.get("restore_memory_s"):
                text += f"; K=all {full['restore_memory_s'] * 1000:.0f} ms (target not slower: " \
                        f"{verdict(memory <= full['restore_memory_s'] * 1.05)})"
            if m.get("restore_memory_phases_s"):
                text += f" [ms: {report.phase_list(m['restore_memory_phases_s'])}"
                if dl.get("restore_memory_phases_s"):
                    text += f"; DLRover: {report.phase_list(dl['restore_memory_phases_s'])}"
                text += "]"
            out.append(text)
        if storage and dl.get("restore_storage_s"):
            out.append(f"{name}: restore from storage {storage * 1000:.0f} ms, checksums verified; DLRover "
                       f"{dl['restore_storage_s'] * 1000:.0f} ms (target at least as fast: "
                       f"{verdict(storage <= dl['restore_storage_s'])})"
                       + (f" [ms: {report.phase_list(m['restore_storage_phases_s'])}]"
                          if m.get("restore_storage_phases_s") else ""))
    if full.get("blocking_s_median") and full.get("memcpy_floor_s"):
        ratio = full["blocking_s_median"] / full["memcpy_floor_s"]
        out.append(f"megatron-pec K=all: blocking {ratio:.2f}× the memcpy floor "
                   f"(target ≤ 1.2×: {verdict(ratio <= 1.2)})"
                   + (f" [ms: {report.phase_list(full['save_phases_s'])}]" if full.get("save_phases_s") else ""))
    if full.get("train_throughput_ratio") and dl.get("train_throughput_ratio"):
        out.append(f"throughput with a checkpoint every iteration: K=all {full['train_throughput_ratio']:.2f}, DLRover "
                   f"{dl['train_throughput_ratio']:.2f} (target ≥ DLRover: "
                   f"{verdict(full['train_throughput_ratio'] >= dl['train_throughput_ratio'])})")
    one = ms.get("megatron-pec K=1", {})
    if one.get("train_throughput_ratio"):
        text = (f"throughput with a checkpoint every iteration: K=1 {one['train_throughput_ratio']:.2f} "
                f"(target ≥ 0.9: {verdict(one['train_throughput_ratio'] >= 0.9)})")
        if one.get("save_phases_s"):
            text += f" [save blocks {one['blocking_s_median'] * 1000:.1f} ms: {report.phase_list(one['save_phases_s'])}"
            per = one.get("agent_cpu_by_phase_s_per_save")
            if per:
                text += (f"; the node agent's CPU per checkpoint {sum(per.values()) * 1000:.0f} ms: "
                         f"{report.phase_list(per)}")
            text += "]"
        out.append(text)
    return out


def host_path_and_restore_targets(ms: dict) -> list[str]:
    """The four targets for CPU ranks, all experts, all in one run: the save's costs besides its copy,
    both restores no slower than DLRover's, the restore from storage within 1.3x the cold read of its files."""
    full, dl = ms.get("megatron-pec K=all", {}), ms.get("DLRover flash ckpt", {})
    checks = []  # (what, met)
    if full.get("save_phases_s"):
        besides = sum(s for phase, s in full["save_phases_s"].items() if phase != "copy")
        checks.append((f"the save besides its copy {besides * 1000:.2f} ms (≤ 0.5 ms)", besides <= 0.0005))
    for tier in ("memory", "storage"):
        ours, theirs = full.get(f"restore_{tier}_s"), dl.get(f"restore_{tier}_s")
        if ours and theirs:
            checks.append((f"restore from {tier} {ours * 1000:.1f} ms, DLRover {theirs * 1000:.1f} ms (no slower)",
                           ours <= theirs))
    storage, floor = full.get("restore_storage_s"), full.get("restore_storage_floor_s")
    if storage and floor:
        each = zip(full.get("restore_storage_s_all", []), full.get("restore_storage_floor_s_all", []))
        paired = ", ".join(f"{s / f:.2f}" for s, f in each)
        checks.append((f"restore from storage {storage / floor:.2f}× the cold read of its files by one reader "
                       f"right before each restore, {floor * 1000:.1f} ms median (≤ 1.3×; each restore against "
                       f"the read before it: {paired})", storage <= 1.3 * floor))
    if not checks:
        return []
    met = sum(ok for _, ok in checks)
    return [f"megatron-pec K=all, the CPU targets: {met} of {len(checks)} met in this run: "
            + "; ".join(f"{what}: {'met' if ok else 'NOT met'}" for what, ok in checks)]

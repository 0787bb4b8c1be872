"""Markdown table and PNG plots from a benchmarks.checkpoint JSON result.

    python -m benchmarks.report benchmarks/results/quick.json   # re-render without re-measuring
    python -m benchmarks.report --headline benchmarks/results/full.json   # the README's ratio table
"""

from __future__ import annotations

import json
import os
import sys


def _ms(x):
    return "–" if x is None else f"{x * 1000:.1f}"


def _mb(x):
    return "–" if x is None else f"{x / 1e6:.1f}"


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def method_table(run: dict) -> str:
    fl = run["floors"]
    ref = run["methods"].get("torch_dist sync", {}).get("blocking_s_median")
    lines = [
        "| method | blocking ms (median / p90 / min) | × memcpy floor | torch_dist sync ÷ this | bytes/rank MB "
        "(storage) | snapshot MB/rank | persist MB/s (% of write floor) | restore memory s (× memcpy floor) "
        "| restore storage s | throughput, ckpt every it (vs none) | persisting process CPU s/GB | fsync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in run["methods"].items():
        floor = m.get("memcpy_floor_s")  # only methods that snapshot to memory have a memcpy floor
        over = m["blocking_s_median"] / floor if floor and m.get("blocking_s_median") else None
        speed = ref / m["blocking_s_median"] if ref and m.get("blocking_s_median") else None
        pct = 100 * m["persist_MBps"] / fl["write_MBps"] if m.get("persist_MBps") else None
        lines.append(
            f"| {name} | {_ms(m.get('blocking_s_median'))} / {_ms(m.get('blocking_s_p90'))} / "
            f"{_ms(min(m['blocking_s_all']) if m.get('blocking_s_all') else None)} | {_f(over, '{:.1f}×')} "
            f"| {_f(speed, '{:.1f}×')} | {_mb(m.get('bytes_per_rank'))} | {_mb(m.get('snapshot_bytes_per_rank'))} "
            f"| {_f(m.get('persist_MBps'), '{:.0f}')} ({_f(pct, '{:.0f}%')}) "
            f"| {_f(m.get('restore_memory_s'), '{:.3f}')} "
            f"({_f(m['restore_memory_s'] / restore_floor(fl) if m.get('restore_memory_s') else None, '{:.1f}×')}) "
            f"| {_f(m.get('restore_storage_s'), '{:.3f}')} | {_f(m.get('train_throughput_ratio'), '{:.2f}')} "
            f"| {_f(m.get('agent_cpu_s_per_GB'), '{:.2f}')} | {'yes' if m.get('fsync') else 'no'} |")
    return "\n".join(lines)


def phase_list(phases: dict | None, keep: float = 0.00005) -> str:
    """``"copy 6.6, param sync 2.4"`` (ms), largest first, phases under ``keep`` seconds left out."""
    if not phases:
        return "–"
    ranked = sorted(((s, n) for n, s in phases.items() if s >= keep), reverse=True)
    return ", ".join(f"{n} {s * 1000:.1f}" for s, n in ranked)


def restore_floor(fl: dict) -> float:
    """A restore from node memory's copy floor: out of tmpfs (older results: into it)."""
    return fl.get("memcpy_from_tmpfs_s") or fl["memcpy_s"]


def breakdown_tables(run: dict) -> list[str]:
    """Where a save's, a memory restore's, a storage restore's and the persisting process's time goes,
    per method."""
    ms, fl = run["methods"], run["floors"]
    out = _phase_table(
        ms, "save_phases_s", "Blocking save by phase (ms; median over the measured saves, each the slower rank's; "
        "floor: one memcpy of the snapshot's bytes):", ["blocking", "floor"],
        lambda m: [_ms(m.get("blocking_s_median")), _ms(m.get("memcpy_floor_s"))])
    out += _phase_table(
        ms, "restore_memory_phases_s", "Restore from node memory by phase (ms; median over the restores, each the "
        f"slower rank's; floor: one memcpy of the optimizer state out of tmpfs, {restore_floor(fl) * 1000:.1f} ms):",
        ["restore"], lambda m: [_ms(m.get("restore_memory_s"))])
    out += _phase_table(
        ms, "restore_storage_phases_s", "Restore from storage by phase (ms; median over the restores, each the "
        "slower rank's; each by a fresh engine after the files left the page cache; floor: one reader's cold read "
        "of the files it restores, right before each restore, median):",
        ["restore", "floor"], lambda m: [_ms(m.get("restore_storage_s")), _ms(m.get("restore_storage_floor_s"))])
    out += _phase_table(
        ms, "agent_cpu_by_phase_s_per_save", "Persisting process (the node agent) CPU per checkpoint by phase (ms, "
        "both ranks' rank files; 'other' is its CPU time outside the phases: serving messages):",
        ["CPU per checkpoint"], lambda m: [f"{sum(m['agent_cpu_by_phase_s_per_save'].values()) * 1000:.1f}"])
    return out


def _phase_table(ms: dict, key: str, title: str, columns: list[str], cells) -> list[str]:
    """A table of the methods that measured ``key`` (seconds by phase): ``columns`` (``cells(method)``)
    before the phases, largest first."""
    rows = [f"| {name} | {' | '.join(cells(m))} | {phase_list(m[key])} |" for name, m in ms.items() if m.get(key)]
    return [title, "", f"| method | {' | '.join(columns)} | phases |", "|---" * (len(columns) + 2) + "|", *rows, ""]


def headline(result: dict) -> str:
    """Ratios only (machine-independent-ish), for the README: the largest model of the run."""
    run = result["runs"][-1]
    ms, fl = run["methods"], run["floors"]
    td = ms.get("torch_dist sync", {})
    full = ms.get("megatron-pec K=all", {})
    lines = [f"{describe_model(run['model'])}; ratios from `{result['command']}`", "",
             "| method | save blocks training (vs torch_dist sync) | blocking ÷ memcpy floor | bytes/rank vs K=all "
             "| persist rate ÷ write+fsync floor | restore from storage (vs torch_dist) | restore from memory "
             "÷ memcpy floor | throughput, ckpt every iteration |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in ms.items():
        b = m.get("blocking_s_median")
        rel = f"{b / td['blocking_s_median']:.3f}× ({td['blocking_s_median'] / b:.0f}× less)" \
            if b and td.get("blocking_s_median") else "–"
        floor = f"{b / m['memcpy_floor_s']:.1f}×" if b and m.get("memcpy_floor_s") else "–"
        size = f"{m['bytes_per_rank'] / full['bytes_per_rank']:.2f}" if full.get("bytes_per_rank") and \
            m.get("bytes_per_rank") else "–"
        pr = f"{m['persist_MBps'] / fl['write_MBps']:.0%}" if m.get("persist_MBps") else "–"
        rs = f"{m['restore_storage_s'] / td['restore_storage_s']:.2f}×" if m.get("restore_storage_s") and \
            td.get("restore_storage_s") else "–"
        rm = f"{m['restore_memory_s'] / restore_floor(fl):.1f}×" if m.get("restore_memory_s") else "–"
        tp = f"{m['train_throughput_ratio']:.2f}" if m.get("train_throughput_ratio") else "–"
        lines.append(f"| {name} | {rel} | {floor} | {size} | {pr}{'' if m.get('fsync') else ' (no fsync)'} | {rs} "
                     f"| {rm} | {tp} |")
    return "\n".join(lines)


def describe_model(model: dict) -> str:
    return (f"GPT-MoE {model['num_layers']} layers, hidden {model['hidden_size']}, {model['num_experts']} experts "
            f"(top-{model['moe_router_topk']}, expert FFN {model['moe_ffn_hidden_size']}), EP {model['ep']} × "
            f"DP {model['dp']} on {model['world_size']} ranks; optimizer state "
            f"{model['optimizer_state_bytes_per_rank'] / 1e6:.0f} MB per rank")


def markdown(result: dict) -> str:
    mach = result["machine"]
    out = [f"# Checkpoint benchmark ({result['mode']})", "",
           f"Command: `{result['command']}`", "",
           f"Machine: {mach.get('cpu')}, {mach.get('cores')} cores, {mach.get('memory_gib')} GiB, no GPU; "
           f"storage {mach.get('storage')}; node memory {mach.get('node_memory')}; "
           f"1-min load before each run: {', '.join(str(x) for x in mach.get('load_1min_before_runs', []))}", ""]
    out += ["## Headline (ratios, largest model)", "", headline(result), ""]
    for run in result["runs"]:
        fl = run["floors"]
        out += [f"## {describe_model(run['model'])}", "",
                f"Floors (same run): memcpy of {fl['memcpy_bytes_per_rank'] / 1e6:.0f} MB/rank into tmpfs "
                f"{fl['memcpy_s'] * 1000:.1f} ms ({fl['memcpy_GBps_per_rank']:.1f} GB/s per rank, both ranks at once"
                + (f"; out of tmpfs, as a restore copies, {fl['memcpy_from_tmpfs_s'] * 1000:.1f} ms"
                   if fl.get("memcpy_from_tmpfs_s") else "") + ")"
                + (f", or {fl['slices_memcpy_s'] * 1000:.1f} ms as the {fl['slices_count_per_rank']} separate "
                   f"optimizer-shard slices a snapshot copies" if fl.get("slices_memcpy_s") else "") + "; "
                f"sequential write + fsync {fl['write_MBps']:.0f} MB/s (one writer), "
                f"{fl['write_MBps_parallel']:.0f} MB/s (one writer per rank). "
                f"Training without checkpoints: {run['baseline_s_per_iteration'][0] * 1000:.0f} / "
                f"{run['baseline_s_per_iteration'][1] * 1000:.0f} ms per iteration (start / end of run).", "",
                method_table(run), ""] + breakdown_tables(run)
        if run.get("errors"):
            out += ["Methods that failed here: " + "; ".join(f"{k}: {v}" for k, v in run["errors"].items()), ""]
    sc = result.get("scaling")
    if sc:
        out += [f"## Scaling with the number of experts (hidden {sc['hidden_size']}, {sc['num_layers']} layers, "
                f"top-{sc['moe_router_topk']}: fixed compute per token)", "",
                "| experts | optimizer state MB/rank | full: blocking ms | full: persisted MB/rank | K=1: blocking ms "
                "| K=1: persisted MB/rank | K=1 persisted bytes vs full |", "|---|---|---|---|---|---|---|"]
        for p in sc["points"]:
            red = 1 - p["K=1"]["bytes_per_rank"] / p["full"]["bytes_per_rank"]
            out.append(f"| {p['num_experts']} | {p['optimizer_state_bytes_per_rank'] / 1e6:.1f} | "
                       f"{_ms(p['full']['blocking_s_median'])} | {_mb(p['full']['bytes_per_rank'])} | "
                       f"{_ms(p['K=1']['blocking_s_median'])} | {_mb(p['K=1']['bytes_per_rank'])} | −{red:.0%} |")
        out.append("")
    if result.get("targets"):
        out += ["## Targets", ""] + [f"* {t}" for t in result["targets"]] + [""]
    out += ["Notes: blocking = time the training loop is stopped by one save (slowest rank). Persist MB/s = the "
            "node's bytes for that checkpoint ÷ time from the save call until it is durable and committed "
            "(megatron-pec: manifest written; torch_dist async: finalize; DLRover: its tracker file), "
            "compared with one writer's write+fsync floor. `fsync: no` methods (Megatron legacy torch.save, "
            "DLRover) return before their bytes reach the disk, so their persist rate is partly page-cache speed. "
            "Restore = time until the training state is back in place; restore from storage is the median of "
            "five, each after dropping the page cache of the files (megatron-pec: each by a fresh engine "
            "without node memory), started after a sync and a 3 s pause (the disk no longer flushing the "
            "method's own saves); restore from memory is the median of seven restores into the running job, its "
            "floor one memcpy of the optimizer state out of tmpfs. "
            "Throughput = iterations/s with a checkpoint every iteration "
            "÷ without (the faster of two runs without checkpoints, right before and right after the method's). "
            "Persisting process CPU = the node agent's CPU seconds during the measured saves per GB the "
            "node persisted (carrying experts forward included).", ""]
    return "\n".join(out)


def plots(result: dict, out_dir: str, stem: str) -> list[str]:
    """The three figures (blocking and bytes, throughput, scaling where measured); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = result["runs"][-1]  # the largest model
    figures = [(_blocking_and_bytes(plt, run), "blocking_bytes"), (_throughput(plt, run), "throughput")]
    if result.get("scaling"):
        figures.append((_scaling(plt, result["scaling"]), "scaling"))
    written = []
    for fig, name in figures:
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}_{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _blocking_and_bytes(plt, run: dict):
    names = list(run["methods"])
    ms = run["methods"]
    floor_Bps = run["floors"]["memcpy_bytes_per_rank"] / run["floors"]["memcpy_s"]
    colors = ["tab:blue" if ms[n]["family"] == "pec" else "tab:gray" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    bars = ax.bar(range(len(names)), [ms[n]["blocking_s_median"] * 1000 for n in names], color=colors)
    floors_ms = [(ms[n].get("snapshot_bytes_per_rank") or 0) / floor_Bps * 1000 for n in names]
    ax.scatter(range(len(names)), floors_ms, color="tab:red", marker="_", s=400, zorder=3,
               label="memcpy floor of the bytes it snapshots")
    ax.set_yscale("log")
    ax.set_ylabel("blocking time per save (ms, log)")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.legend(fontsize=8)
    ax.set_title("Blocking time of one save (median)")
    ax = axes[1]
    bars = ax.bar(range(len(names)), [(ms[n]["bytes_per_rank"] or 0) / 1e6 for n in names], color=colors)
    ax.set_ylabel("bytes written to storage per rank (MB, slowest rank)")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_title("Checkpoint size per rank")
    fig.suptitle(describe_model(run["model"]), fontsize=9)
    return fig


def _throughput(plt, run: dict):
    ms = run["methods"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in ms:
        by = ms[n].get("throughput_ratio_by_interval") or {}
        xs = sorted(int(k) for k in by)
        ax.plot(xs, [by[str(x)] for x in xs], marker="o", label=n,
                linestyle="-" if ms[n]["family"] == "pec" else "--")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("checkpoint interval (iterations)")
    ax.set_ylabel("training throughput vs no checkpoints")
    ax.legend(fontsize=7)
    ax.set_title("Training throughput vs checkpoint interval")
    return fig


def _scaling(plt, sc: dict):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    es = [p["num_experts"] for p in sc["points"]]
    for label, style in (("full", "--"), ("K=1", "-")):
        axes[0].plot(es, [p[label]["blocking_s_median"] * 1000 for p in sc["points"]], style, marker="o",
                     label=f"megatron-pec {label}")
        axes[1].plot(es, [p[label]["bytes_per_rank"] / 1e6 for p in sc["points"]], style, marker="o",
                     label=f"megatron-pec {label}")
    for ax, title in ((axes[0], "blocking time per save (ms)"), (axes[1], "persisted MB per rank")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(es, [str(e) for e in es])
        ax.set_xlabel("experts per MoE layer (fixed compute: top-k and expert size fixed)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--headline":
        with open(argv[1]) as f:
            print(headline(json.load(f)))
        return 0
    with open(argv[0]) as f:
        result = json.load(f)
    out_dir = os.path.dirname(os.path.abspath(argv[0]))
    stem = os.path.splitext(os.path.basename(argv[0]))[0]
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown(result))
    print("\n".join(plots(result, out_dir, stem)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

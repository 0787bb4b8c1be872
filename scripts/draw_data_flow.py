"""Draws docs/images/data_flow.png, the README's picture of how the parts fit (needs matplotlib: the bench extra)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the back end is chosen)
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402 (likewise)

INK, GREEN = "#33475b", "#2e7d32"
BOXES = [  # (x, y, width, height, title, lines, colour)
    (0.5, 3.6, 3.0, 1.9, "trainer ranks",
     ["Megatron-LM training loop", "save_checkpoint / load_checkpoint", "(megatron-pec, drop-in)"], "#e4f1e1"),
    (5.0, 3.6, 3.0, 1.9, "node memory (tmpfs)",
     ["per rank: 2 home slots (dense state)", "+ expert pool (K experts a save)", "+ peers' replicas"], "#fdf2d9"),
    (5.0, 0.55, 3.0, 2.2, "node agent",
     ["one process per node and job", "records, persists, commits", "pushes replicas to a peer,",
      "serves pulls after a node loss"], "#dbe9f6"),
    (0.5, 0.55, 3.0, 2.2, "selection (PEC)",
     ["every save: all dense state", "+ K experts per MoE layer", "(sequential, load-aware,",
      "popularity; Dynamic-K)"], "#efe4f4"),
    (9.9, 3.6, 3.6, 1.9, "storage",
     ["POSIX or object store (msc://)", "iter_N/pec/rank_*.safetensors", "manifest written last: the commit"],
     "#e8e8e8"),
    (9.9, 0.55, 3.6, 2.2, "a peer node's agent",
     ["keeps a verified replica", "of this node's snapshots", "in its own node memory", "(checked as it lands)"],
     "#dbe9f6"),
]
ARROWS = [  # (from, to, label, colour, style, label offset)
    ((3.5, 4.95), (5.0, 4.95), "1 copy + checksums", INK, "-|>", 0.06),
    ((5.0, 4.15), (3.5, 4.15), "restore, same node", GREEN, "-|>", 0.06),
    ((2.0, 2.75), (2.0, 3.6), "", INK, "-|>", 0),
    ((3.5, 3.75), (5.0, 2.5), "2 announce", INK, "-|>", -0.05),
    ((6.5, 3.6), (6.5, 2.75), "", INK, "<|-|>", 0),
    ((8.0, 2.45), (9.9, 3.9), "4 persist, commit", INK, "-|>", 0.02),
    ((8.0, 1.0), (9.9, 1.0), "5 push replicas", INK, "-|>", 0.06),
    ((9.9, 1.75), (8.0, 1.75), "pull after a node loss", GREEN, "-|>", 0.06),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(13.8, 6.8), dpi=110)
    ax.set_xlim(0, 13.7)
    ax.set_ylim(0, 6.6)
    ax.axis("off")
    ax.add_patch(FancyBboxPatch((0.2, 0.25), 8.1, 5.75, boxstyle="round,pad=0.02,rounding_size=0.15",
                                fc="#f7f9fb", ec="#8796a5", lw=1, ls="--"))
    ax.text(0.4, 5.9, "one node", fontsize=10, color="#56687a", style="italic", va="top")
    for x, y, w, h, title, lines, colour in BOXES:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=colour, ec=INK,
                                    lw=1.3))
        ax.text(x + w / 2, y + h - 0.25, title, ha="center", va="top", fontsize=11, weight="bold", color="#1b2a38")
        for i, line in enumerate(lines):
            ax.text(x + w / 2, y + h - 0.62 - 0.3 * i, line, ha="center", va="top", fontsize=8.6, color="#1b2a38")
    for a, b, label, colour, style, dy in ARROWS:
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=14, lw=1.5, color=colour))
        if label:
            ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, label, ha="center", va="bottom", fontsize=8.3,
                    color=colour)
    ax.text(2.1, 3.18, "which experts", fontsize=8.3, color=INK, va="center")
    ax.text(6.6, 3.18, "3 read its regions", fontsize=8.3, color=INK, va="center")
    ax.add_patch(FancyArrowPatch((11.7, 5.5), (2.0, 5.5), arrowstyle="-|>", mutation_scale=14, lw=1.5, color=GREEN,
                                 connectionstyle="arc3,rad=0.12"))
    ax.text(6.9, 6.25, "restore from storage only when no copy in memory is left", fontsize=8.6, color=GREEN,
            ha="center")
    fig.savefig(Path(__file__).resolve().parents[1] / "docs" / "images" / "data_flow.png", bbox_inches="tight")


if __name__ == "__main__":
    main()

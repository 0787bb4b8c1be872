"""Pristine Megatron-LM trees of the supported releases, for tests that need the real training loop.

A tree comes from ``$MEGATRON_LM_ARCHIVES`` or ``<checkout>/../shared/megatron-lm/`` (archives
``Megatron-LM-<tag>.tar.gz`` that unpack to ``Megatron-LM/``), unpacked once per machine under
``$TMPDIR/megatron_pec_megatron_lm/<tag>/``; callers copy it before changing anything.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

RELEASES = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0")
OLDEST, NEWEST = RELEASES[0], RELEASES[-1]
# A small GPT-MoE that pretrain_gpt.py trains on 2 CPU ranks (gloo, mock data, no fused kernels), dropout off.
SMALL_MOE_ON_CPU = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 64 "
    "--max-position-embeddings 64 --num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
    "--moe-token-dispatcher-type allgather --moe-router-enable-expert-bias --moe-router-score-function sigmoid "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 1 --use-distributed-optimizer --distributed-backend gloo --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 256 --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
    "--no-rope-fusion --hidden-dropout 0 --attention-dropout 0 --eval-interval 1000 --eval-iters 1").split()
_REPO = Path(__file__).resolve().parents[2]


def archive_dirs() -> list[Path]:
    dirs = [Path(os.environ["MEGATRON_LM_ARCHIVES"])] if os.environ.get("MEGATRON_LM_ARCHIVES") else []
    return dirs + [_REPO.parent / "shared" / "megatron-lm"]


def archive(tag: str) -> Path | None:
    for d in archive_dirs():
        path = d / f"Megatron-LM-{tag}.tar.gz"
        if path.is_file():
            return path
    return None


def pristine_tree(tag: str) -> Path | None:
    """The unpacked tree of ``tag`` (read-only by convention), or None when no archive holds it."""
    if tag not in RELEASES:
        raise ValueError(f"unknown release {tag}; supported: {', '.join(RELEASES)}")
    source = archive(tag)
    if source is None:
        return None
    root = Path(tempfile.gettempdir()) / "megatron_pec_megatron_lm" / tag
    tree = root / "Megatron-LM"
    done = root / ".unpacked"
    if done.is_file() and done.read_text() == str(source.stat().st_mtime_ns):
        return tree
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root))
    try:
        with tarfile.open(source) as tar:
            tar.extractall(staging, filter="data")
        shutil.rmtree(tree, ignore_errors=True)
        os.replace(staging / "Megatron-LM", tree)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    done.write_text(str(source.stat().st_mtime_ns))
    return tree


def copy_tree(tag: str, dest: Path) -> Path | None:
    """A private copy of ``tag``'s tree at ``dest`` (None when no archive holds it)."""
    tree = pristine_tree(tag)
    if tree is None:
        return None
    shutil.copytree(tree, dest, symlinks=True)
    return dest

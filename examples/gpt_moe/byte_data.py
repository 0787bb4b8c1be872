"""Real text with no downloads: the Python standard library's own source files.

Builds a Megatron indexed dataset (``.bin``/``.idx``) once per machine with
byte-level tokens (256 byte values + end-of-document), and serves it through
megatron-core's ``GPTDataset`` / ``BlendedMegatronDatasetBuilder`` exactly as
Megatron-LM's ``pretrain_gpt.py`` does.
"""

from __future__ import annotations

import fcntl
import os
import sysconfig
from pathlib import Path

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

try:
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
except ImportError:  # megatron-core >= 0.19 moved its tokenizers; the datasets need only this interface
    class MegatronLegacyTokenizer:
        def __init__(self, *args, **kwargs):
            self.unique_identifiers = {"class": type(self).__name__}

STDLIB_MODULES = 200  # ~4.7 MB of text
DEFAULT_CACHE = Path(__file__).resolve().parents[2] / "data_cache"


class ByteTokenizer(MegatronLegacyTokenizer):
    """UTF-8 bytes as token ids 0..255, end-of-document 256."""

    def __init__(self):
        super().__init__("byte-level")

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def vocab(self):
        return {bytes([i]).hex(): i for i in range(256)}

    @property
    def inv_vocab(self):
        return {i: bytes([i]).hex() for i in range(256)}

    @property
    def eod(self) -> int:
        return 256

    def tokenize(self, text: str) -> numpy.ndarray:
        return numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8).astype(numpy.int32)

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def stdlib_sources(limit: int = STDLIB_MODULES) -> list[Path]:
    """The first ``limit`` top-level standard-library modules, in a stable order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))[:limit]


def default_data_prefix(cache_dir: Path = DEFAULT_CACHE) -> str:
    return str(cache_dir / "stdlib_text_document")


def ensure_stdlib_dataset(prefix: str) -> str:
    """Build ``prefix.bin/.idx`` from the standard library once; safe to call from many processes."""
    prefix_path = Path(prefix)
    if Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists():
        return prefix
    prefix_path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait and then reuse
        if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
            tokenizer = ByteTokenizer()
            tmp = f"{prefix}.tmp{os.getpid()}"
            builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=numpy.uint16)
            for source in stdlib_sources():
                ids = tokenizer.tokenize(source.read_text(encoding="utf-8", errors="replace"))
                builder.add_item(torch.from_numpy(numpy.append(ids, tokenizer.eod)))
                builder.end_document()
            builder.finalize(f"{tmp}.idx")
            os.replace(f"{tmp}.bin", f"{prefix}.bin")  # .bin first: .idx marks completeness
            os.replace(f"{tmp}.idx", f"{prefix}.idx")
    return prefix


def build_datasets(prefix: str, seq_length: int, seed: int, train_samples: int,
                   valid_samples: int, split: str = "98,2,0"):
    """Train and validation GPTDatasets over ``prefix`` (all ranks must call this)."""
    if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
        raise SystemExit(f"error: --data-path {prefix}: {prefix}.bin/.idx not found")
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=str(Path(prefix).parent / "index_cache"),
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
    )
    # Megatron's idiom is "TP rank 0"; with TP = 1 every rank reads data (rank 0 builds the index first).
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, None], lambda: True, config
    ).build()
    return train, valid


def batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """Micro-batches for this DP rank, resuming exactly after ``consumed_samples``.

    Same order as Megatron's ``MegatronPretrainingSampler``: each global step of
    ``micro_batch_size * dp_size`` samples is cut into contiguous per-rank parts.
    """
    step = micro_batch_size * dp_size
    start = consumed_samples
    while True:
        first = start % len(dataset) + dp_rank * micro_batch_size
        samples = [dataset[(first + i) % len(dataset)] for i in range(micro_batch_size)]
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        start += step

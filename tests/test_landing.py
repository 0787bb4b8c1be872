"""A rank file read straight into the live host tensors (``restore/landing.py``): the loader reads and checks
only its header (deciding writes nothing), the restore reads the file in step 6; every byte lands where the
restore would have copied it, runs contiguous in the file and in memory are one read, a tensor without such
a place is kept in a buffer of its own, and a corrupt file is refused by its checksum. Device tensors land
through a ring of staging buffers (``restore/read_ring.py``; here a host "device", as
``MEGATRON_PEC_CHECK_ON_DEVICE=1`` runs it on CPU ranks), each buffer handed out again only once read, copied
and summed. Real files through ``PosixStorage``; no Megatron."""

import zlib

import numpy
import pytest
import torch

from megatron_pec.format.protocol import RankFile, SlotHeader
from megatron_pec.format.stformat import encode_header, layout
from megatron_pec.restore.landing import LandingError, land_rank_file
from megatron_pec.restore.read_ring import DeviceReadRing
from megatron_pec.restore.sources import Source, SourceError, read_checked_header
from megatron_pec.store.storage import PosixStorage

pytestmark = pytest.mark.megatron_free

SPECS = [("dense/a", torch.float32, 1000), ("dense/b", torch.float32, 24), ("dense/c", torch.bfloat16, 7),
         ("L1.E0/w", torch.float32, 300), ("L1.E0/x", torch.float32, 5)]


class CountingStorage(PosixStorage):
    """Records the size and address of each piece it is handed, as it reads it, and the files it is asked to
    fetch ahead."""

    prefetched: tuple = ()

    def prefetch(self, path):
        self.prefetched += (path,)

    def read_checked_into(self, path, pieces):
        self.pieces, self.addresses = [], []

        def counted():
            for piece in pieces:
                self.pieces.append(len(memoryview(piece).cast("B")))
                self.addresses.append(numpy.frombuffer(piece, dtype=numpy.uint8).ctypes.data)
                yield piece

        return super().read_checked_into(path, counted())


def rank_file(tmp_path, flip: int | None = None):
    """(path, manifest entry, name -> saved values) of a rank file of SPECS; ``flip``: a data byte changed
    after its checksum was taken."""
    entries = layout(SPECS)
    saved = {name: torch.randn(numel).to(dtype) for name, dtype, numel in SPECS}
    header = SlotHeader(job_id="job", fingerprint="cfg", save="/ckpt", rank=0, world_size=1, iteration=4,
                        items={"dense": 4, "L1.E0": 4}, tokens={"L1.E0": 40}, small="{}", pec="{}", run="a", sums={})
    head = encode_header(entries, header.to_metadata())
    data = b"".join(bytes(saved[e.name].view(torch.uint8).numpy()) for e in entries)
    entry = RankFile(file="rank.safetensors", size=len(head) + len(data), crc32=zlib.crc32(head + data),
                     items=["dense", "L1.E0"], header_crc32=zlib.crc32(head))
    if flip is not None:
        data = bytearray(data)
        data[flip] ^= 1
    path = tmp_path / "rank.safetensors"
    path.write_bytes(head + bytes(data))
    return str(path), entry, saved


def header_of(path, entry):
    """The header as the loader reads and checks it (``Source.open(read_later=True)``)."""
    return read_checked_header(path, entry, PosixStorage())


def live_tensors():
    """a and b follow each other in one buffer, E0/w follows them there (not in the file); c has its own
    buffer; E0/x has no place."""
    big = torch.zeros(1024 + 300)
    return {"dense/a": big[:1000], "dense/b": big[1000:1024], "L1.E0/w": big[1024:],
            "dense/c": torch.zeros(7, dtype=torch.bfloat16)}


def test_every_byte_lands_where_the_restore_copies_it(tmp_path):
    path, entry, saved = rank_file(tmp_path)
    live, storage = live_tensors(), CountingStorage()
    landed, kept = land_rank_file(path, entry, header_of(path, entry), storage, live)
    assert set(landed) == {"dense/a", "dense/b", "dense/c", "L1.E0/w"} and set(kept) == {"L1.E0/x"}
    for name in landed:
        assert landed[name] is live[name] and torch.equal(live[name], saved[name]), name
    # a and b follow each other in the file and in memory: one read; c and E0/w each one; x its own buffer
    assert storage.pieces[1:] == [1024 * 4, 7 * 2, 300 * 4, 5 * 4]
    # Through the loader's source: opened, only the header is read; the restore's read lands the rest
    live = {name: torch.zeros_like(t) for name, t in live_tensors().items()}
    source = Source("storage", 4, {"dense": 4, "L1.E0": 4}, path, {}, rank_file=entry)
    storage.pieces = None
    source.open(storage, read_later=True)
    assert source.read_later and storage.pieces is None  # (no data read while the loader decides)
    assert storage.prefetched == ()  # (nor fetched ahead before the ranks agreed: the loader asks then)
    source.fetch_ahead(storage)
    assert storage.prefetched == (path,)
    rest = source.read_into(storage, live, {"dense/a", "L1.E0/w", "L1.E0/x"})
    assert set(rest) == {"L1.E0/x"} and torch.equal(rest["L1.E0/x"], saved["L1.E0/x"])
    assert torch.equal(live["dense/a"], saved["dense/a"]) and torch.equal(live["L1.E0/w"], saved["L1.E0/w"])
    assert torch.count_nonzero(live["dense/b"]) == 0  # (not asked for: read, not landed)


def test_a_tensor_of_another_dtype_or_size_does_not_land(tmp_path):
    path, entry, saved = rank_file(tmp_path)
    live = {"dense/a": torch.zeros(1000, dtype=torch.float64), "dense/b": torch.zeros(23)}
    landed, kept = land_rank_file(path, entry, header_of(path, entry), PosixStorage(), live)
    assert landed == {} and torch.equal(_view(kept["dense/a"], saved["dense/a"]), saved["dense/a"])


def _view(piece, like):
    buffer, offset = piece
    return torch.frombuffer(buffer, dtype=like.dtype, count=like.numel(), offset=offset)


def test_a_corrupt_file_is_refused_by_its_checksum(tmp_path):
    path, entry, _ = rank_file(tmp_path, flip=4001)
    with pytest.raises(LandingError, match="fails its checksum"):
        land_rank_file(path, entry, header_of(path, entry), PosixStorage(), live_tensors())
    source = Source("storage", 4, {"dense": 4, "L1.E0": 4}, path, {}, rank_file=entry)
    source.open(PosixStorage(), read_later=True)  # (the header is sound)
    with pytest.raises(SourceError, match="fails its checksum"):
        source.read_into(PosixStorage(), live_tensors(), {"dense/a"})


def test_only_a_file_read_whole_later_is_fetched_ahead(tmp_path):
    path, entry, _ = rank_file(tmp_path)
    source, storage = Source("storage", 4, {"dense": 4, "L1.E0": 4}, path, {}, rank_file=entry), CountingStorage()
    source.open(storage)  # (read and checked now, whole: nothing left to fetch)
    source.fetch_ahead(storage)
    assert storage.prefetched == ()


def test_a_truncated_file_lands_nothing(tmp_path):
    path, entry, _ = rank_file(tmp_path)
    header = header_of(path, entry)  # (read by the loader; the file is cut short before the restore reads it)
    with open(path, "r+b") as f:
        f.truncate(entry.size - 10)
    live = live_tensors()
    with pytest.raises(LandingError, match="the manifest says"):
        land_rank_file(path, entry, header, PosixStorage(), live)
    assert all(torch.count_nonzero(t) == 0 for t in live.values())



def test_device_tensors_land_through_a_ring_of_staging_buffers(tmp_path):
    """Two buffers of 256 bytes: the file's 6 KiB pass through them 24 times, each copied into its place; the
    crc32 the storage took while reading (the buffers rewritten meanwhile) still matches."""
    path, entry, saved = rank_file(tmp_path)
    live, storage = live_tensors(), CountingStorage()
    staging = DeviceReadRing(torch.device("cpu"), buffers=2, buffer_bytes=256)
    landed, kept = land_rank_file(path, entry, header_of(path, entry), storage, live, staging)
    assert set(landed) == {"dense/a", "dense/b", "dense/c", "L1.E0/w"} and set(kept) == {"L1.E0/x"}
    for name in landed:
        assert torch.equal(live[name], saved[name]), name
    # the header, then each landing stretch in buffers of at most 256 bytes, then x's own buffer
    staged = storage.pieces[1:-1]
    assert sum(staged) == (1024 + 300) * 4 + 7 * 2 and max(staged) == 256
    assert len(set(storage.addresses[1:-1])) == 2 and staging.copies == len(staged)
    assert storage.pieces[-1] == 5 * 4


def test_a_corrupt_file_is_refused_through_the_staging_too(tmp_path):
    path, entry, _ = rank_file(tmp_path, flip=4001)
    with pytest.raises(LandingError, match="fails its checksum"):
        land_rank_file(path, entry, header_of(path, entry), PosixStorage(), live_tensors(),
                       DeviceReadRing(torch.device("cpu"), buffers=2, buffer_bytes=256))


def test_a_buffer_handed_out_again_is_summed_before_it_is_read_into_again(tmp_path):
    """The storage's crc32 runs behind its reads, in a thread: one 4 KiB buffer handed out 256 times still
    gives the file's crc32."""
    data = numpy.random.default_rng(0).integers(0, 256, 1 << 20, dtype=numpy.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    buffer = bytearray(4096)
    assert PosixStorage().read_checked_into(str(path), (buffer for _ in range(256))) == zlib.crc32(data)


def test_a_staging_is_for_the_device_the_targets_are_on():
    host = {"a": torch.zeros(4)}
    assert DeviceReadRing.for_targets(host) is None  # (host tensors land directly)
    assert DeviceReadRing.for_targets(host, host_too=True).device == torch.device("cpu")
    assert DeviceReadRing.for_targets({}, host_too=True) is None

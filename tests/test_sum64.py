"""The checksum computed where the bytes are. One definition (two 64-bit sums over an item's
words, ``megatron_pec/integrity/sum64.py``), three implementations - the C kernel and numpy on the CPU, torch
on the device - that must agree bit for bit with each other and with the definition, however the bytes are cut
into pieces and wherever they lie in memory."""

import random
import shutil
import sysconfig

import numpy
import pytest
import torch

from megatron_pec.format.stformat import Header, layout
from megatron_pec.integrity import sum64
from megatron_pec.integrity.sum64 import DeviceSums, Sum64, digest, is_sum64, item_sums

pytestmark = pytest.mark.megatron_free


def reference(data: bytes) -> str:
    """The definition, word by word in Python."""
    padded = data + bytes(-len(data) % 8)
    a = b = 0
    for k in range(len(padded) // 8):
        x = int.from_bytes(padded[8 * k:8 * k + 8], "little", signed=True)
        a += x
        b += (k + 1) * x
    return digest(a, b)


@pytest.mark.filterwarnings("error")  # (sums wrap mod 2**64 without numpy's overflow warnings)
@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 8 * 4096 - 4, 8 * 4096, 8 * 4096 * 3 + 13, 8 * 4096 * 70 + 5])
def test_the_cpu_sums_follow_the_definition(length, summed_by):
    data = numpy.random.default_rng(length).integers(0, 256, length, dtype=numpy.uint8).tobytes()
    assert Sum64().update(data).hexdigest() == reference(data)


def test_pieces_of_any_size_and_alignment_give_the_same_sums(summed_by):
    rng = random.Random(3)
    data = numpy.random.default_rng(1).integers(0, 256, 3 * 8 * 4096 + 21, dtype=numpy.uint8).tobytes()
    whole = reference(data)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(1, 9)))
        acc = Sum64()
        for begin, end in zip([0] + cuts, cuts + [len(data)]):
            acc.update(memoryview(data)[begin:end])
        assert acc.hexdigest() == whole


@pytest.mark.parametrize("offset", [0, 4, 12, 3])
def test_the_device_implementation_agrees_bit_for_bit(offset):
    """``DeviceSums`` over tensors (pieces of an item at byte ``offset`` on; fp32, fp64, int32, bf16;
    8-aligned in memory or not) equals the numpy sums of the same bytes."""
    rng = numpy.random.default_rng(offset)
    pieces = [torch.from_numpy(rng.standard_normal(4096 * 5 + 3).astype(numpy.float32)),
              torch.from_numpy(rng.standard_normal(17)),
              torch.from_numpy(rng.integers(-2**31, 2**31, 4096 * 2 + 1).astype(numpy.int32)),
              torch.from_numpy(rng.standard_normal(4096 * 3).astype(numpy.float32))[1:],  # 4 bytes off alignment
              torch.randn(33).to(torch.bfloat16)]
    device = DeviceSums("cpu")
    prefix = bytes(range(offset))  # earlier bytes of the item, added on the CPU side only
    acc = Sum64().update(prefix)
    device.add("x", torch.tensor(list(prefix), dtype=torch.uint8), 0) if offset else None
    at = offset
    for piece in pieces:
        device.add("x", piece, at)
        raw = piece.contiguous().view(torch.uint8).numpy().tobytes()
        acc.update(raw)
        at += len(raw)
    assert device.digests(device.result()) == {"x": acc.hexdigest()}
    assert acc.hexdigest() == reference(prefix + b"".join(p.contiguous().view(torch.uint8).numpy().tobytes()
                                                         for p in pieces))


def test_item_sums_read_each_item_of_a_file_in_header_order():
    entries = layout([("dense/a.param", torch.float32, 5), ("L1.E0/w.param", torch.float32, 4099),
                      ("L1.E0/w.exp_avg", torch.float32, 7), ("L1.E1/w.param", torch.float32, 3)])
    header = Header(entries, {}, 16)
    data = numpy.random.default_rng(0).integers(0, 256, header.file_len, dtype=numpy.uint8).tobytes()
    sums = item_sums(data, header, {"L1.E0", "dense"})
    expert = data[header.data_start + entries[1].begin:header.data_start + entries[2].end]
    assert sums == {"L1.E0": reference(expert),
                    "dense": reference(data[header.data_start:header.data_start + entries[0].end])}
    assert is_sum64(sums["dense"]) and not is_sum64(12345)


def test_a_flipped_bit_or_swapped_words_change_the_sums():
    data = bytearray(numpy.random.default_rng(2).integers(0, 256, 8 * 1000, dtype=numpy.uint8).tobytes())
    before = reference(bytes(data))
    flipped = bytearray(data)
    flipped[4321] ^= 0x10
    swapped = bytearray(data)
    swapped[0:8], swapped[800:808] = data[800:808], data[0:8]
    assert reference(bytes(flipped)) != before and reference(bytes(swapped)) != before
    assert Sum64().update(flipped).hexdigest() != before and Sum64().update(swapped).hexdigest() != before


def test_the_kernel_is_built_where_a_c_compiler_is():
    """``pip install`` builds ``_fused_sum64.c`` where a C compiler is (optional: without one the install goes
    on, and numpy sums): here it must have, or the runs above only tested numpy."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the kernel cannot be built here")
    assert sum64._kernel is not None, "megatron_pec/integrity/_fused_sum64.c was not built: run scripts/bootstrap.sh"


@pytest.mark.parametrize("start", [0, 3, 8, 13])
@pytest.mark.parametrize("length", [0, 5, 8 * 4096 * 2 + 11, 8 * 1000])
def test_a_copy_is_exact_and_sums_what_it_copied(summed_by, start, length):
    """``Sum64.copy`` (a restore's copy into the optimizer) from a read-only source at any item offset: the
    bytes land unchanged and the sums are those of ``update`` over them."""
    data = numpy.random.default_rng(length + start).integers(0, 256, length + 1, dtype=numpy.uint8)
    source = data[1:]  # (one byte off 8-byte alignment in memory)
    source.flags.writeable = False
    target = numpy.zeros(length, dtype=numpy.uint8)
    copied = Sum64(start).copy(target, source)
    assert bytes(target) == bytes(source)
    updated = Sum64(start).update(bytes(source))
    assert (copied.a, copied.b, copied.length) == (updated.a, updated.b, updated.length)
    assert Sum64().update(bytes(start)).copy(target, source).hexdigest() == reference(bytes(start) + bytes(source))


@pytest.mark.parametrize("words", [1 << 17, (1 << 17) + 7, 200_003])  # (1 MiB: where the copy streams)
@pytest.mark.parametrize("misaligned", [False, True])
def test_a_large_copy_streams_its_stores_and_still_lands_every_byte_with_its_sums(words, misaligned):
    """A copy of 1 MiB or more stores past the caches, from a destination 16-byte aligned (after one word where
    it is 8 bytes off): the bytes land unchanged, nothing beyond them is written, the sums are the definition's."""
    if sum64._kernel is None:
        pytest.skip("the C kernel is not built here")
    data = numpy.random.default_rng(words).integers(0, 256, 8 * words, dtype=numpy.uint8)
    buffer = numpy.zeros(8 * words + 64, dtype=numpy.uint8)
    start = -buffer.ctypes.data % 16 + (8 if misaligned else 0)
    target = buffer[start:start + 8 * words]
    a, b = sum64._kernel.copy_words(target, data)
    assert bytes(target) == bytes(data)
    assert not buffer[:start].any() and not buffer[start + 8 * words:].any()
    assert digest(a, b) == reference(bytes(data)) and (a, b) == sum64._kernel.sum_words(data)


def test_the_kernel_refuses_what_is_not_whole_words_of_one_length():
    if sum64._kernel is None:
        pytest.skip("the C kernel is not built here")
    with pytest.raises(ValueError, match="not whole 64-bit words"):
        sum64._kernel.sum_words(bytes(12))
    with pytest.raises(ValueError, match="destination of 8 bytes, source of 16"):
        sum64._kernel.copy_words(bytearray(8), bytes(16))
    with pytest.raises(TypeError):
        sum64._kernel.copy_words(bytes(8), bytes(8))  # (a read-only destination)

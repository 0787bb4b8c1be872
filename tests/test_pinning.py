"""The GPU path's page-locking (every CUDA return code checked, one warning and synchronous
copies when pinning fails, unregistered before unmapping, never twice) and the node-memory preflight
against the container's memory limit. The CUDA runtime is a seam: a recording stand-in here."""

import pytest
import torch

from megatron_pec.format.stformat import layout
from megatron_pec.memory import pinning
from megatron_pec.memory.slot_map import SlotMap
from megatron_pec.memory.slots import SlotFiles, SlotSpaceError, cgroup_memory

pytestmark = pytest.mark.megatron_free


class Runtime:
    """Records the runtime calls; ``fail_register`` makes cudaHostRegister return that error code."""

    def __init__(self, fail_register: int = 0):
        self.calls, self.fail_register, self.last_error = [], fail_register, 0

    def cudaHostRegister(self, address, length, flags):
        self.calls.append(("register", address, length))
        self.last_error = self.fail_register
        return self.fail_register

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0

    def cudaGetErrorString(self, code):
        return "out of memory" if code == 2 else "unknown"

    def cudaGetLastError(self):
        code, self.last_error = self.last_error, 0
        return code


@pytest.fixture
def slots(tmp_path):
    files = SlotFiles(str(tmp_path), 0, SlotMap.of(layout([("dense/w.param", torch.float32, 1024)]), 0), 1)
    yield files
    files.close()


def test_pins_each_slot_once_and_unpins_before_unmapping(slots, capsys):
    runtime = Runtime()
    first = pinning.SlotPinning(runtime)
    ranges = pinning.slot_ranges(slots.maps)
    assert first.pin(ranges) and len(first.pinned) == 3  # (two home slots and the expert pool)
    again = pinning.SlotPinning(runtime)
    assert again.pin(ranges) and again.pinned == []  # the same addresses are never registered twice
    assert [c[0] for c in runtime.calls] == ["register"] * 3
    first.unpin_all()
    assert [c[0] for c in runtime.calls[3:]] == ["unregister"] * 3 and not first.pinned
    assert capsys.readouterr().err == ""
    third = pinning.SlotPinning(runtime)
    assert third.pin(ranges) and len(third.pinned) == 3  # registrable again once unregistered
    third.unpin_all()


def test_a_failed_pin_is_one_warning_and_clears_cudas_last_error(slots, capsys):
    runtime = Runtime(fail_register=2)
    pins = pinning.SlotPinning(runtime, rank=3)
    assert not pins.pin(pinning.slot_ranges(slots.maps))
    assert len(runtime.calls) == 1 and runtime.last_error == 0  # stopped at the first failure, error cleared
    text = capsys.readouterr().err
    assert text.count("WARNING") == 1 and "megatron-pec: WARNING rank 3: cannot page-lock" in text
    assert "cudaHostRegister returned CUDA error 2: out of memory" in text and "ulimit -l" in text
    pins.unpin_all()
    assert len(runtime.calls) == 1  # nothing was registered, nothing to unregister


def test_a_large_mapping_is_registered_in_chunks(monkeypatch):
    """One cudaHostRegister of 512 GiB or more fails on current drivers: large slots go in pieces,
    each unregistered again."""
    monkeypatch.setattr(pinning, "CHUNK", 1000)
    runtime = Runtime()
    pins = pinning.SlotPinning(runtime)
    assert pins.pin([(1 << 40, 2500)])
    assert runtime.calls == [("register", (1 << 40) + offset, length)
                             for offset, length in ((0, 1000), (1000, 1000), (2000, 500))]
    pins.unpin_all()
    assert [c for c in runtime.calls if c[0] == "unregister"] == [
        ("unregister", (1 << 40) + offset) for offset in (0, 1000, 2000)]


def test_the_kernel_stores_into_the_slots_only_where_the_gpu_addresses_them_as_the_host_does(slots, monkeypatch):
    """A snapshot's copy by the checksum kernel stores at the slots' host addresses; it is chosen
    only where the driver gives every pinned piece the same address on the device (CUDA's
    canUseHostPointerForRegisteredMem), not where it gives another, cannot be asked, or pinning failed."""
    monkeypatch.setattr(pinning, "_REGISTERED", set())
    monkeypatch.setattr(pinning, "CHUNK", 4096)  # (several pieces per slot: each is asked)
    ranges = pinning.slot_ranges(slots.maps)
    asked = []

    def same(address):
        asked.append(address)
        return address

    for device_pointer, want in ((same, True), (lambda a: a + (1 << 40), False), (lambda a: None, False)):
        runtime = Runtime()
        runtime.device_pointer = device_pointer
        pins = pinning.SlotPinning(runtime)
        assert pins.pin(ranges)
        assert pins.device_addressable() is want
        pins.unpin_all()
    assert sorted(asked) == sorted(start for address, length in ranges
                                   for start in range(address, address + length, 4096))
    assert not pinning.SlotPinning(Runtime()).device_addressable()  # (a runtime that cannot be asked)
    failed = Runtime(fail_register=2)
    failed.device_pointer = same
    pins = pinning.SlotPinning(failed)
    assert not pins.pin(ranges) and not pins.device_addressable()


def test_preflight_counts_node_memory_against_the_containers_memory_limit(tmp_path, monkeypatch):
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{64 << 20}\n")
    (cgroup / "memory.current").write_text(f"{60 << 20}\n")
    monkeypatch.setenv("MEGATRON_PEC_CGROUP_DIR", str(cgroup))
    assert cgroup_memory() == (64 << 20, 60 << 20, str(cgroup / "memory.max"))
    entries = SlotMap.of(layout([("dense/w.param", torch.float32, 2 << 20)]), 0)  # 8 MiB: 2 homes need 16 MiB
    with pytest.raises(SlotSpaceError) as refused:
        SlotFiles(str(tmp_path / "shm"), 0, entries, 1)
    text = str(refused.value)
    assert "memory limit" in text and "64 MiB, 60 MiB in use" in text and "leaves 4 MiB" in text
    assert "need 17 MiB" in text and "tmpfs itself has" in text and "--memory=" in text
    assert not list((tmp_path / "shm").glob("rank0.*"))  # refused before any file was allocated
    (cgroup / "memory.max").write_text("max\n")
    assert cgroup_memory() is None
    SlotFiles(str(tmp_path / "shm"), 0, entries, 1).close()

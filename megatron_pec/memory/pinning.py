"""Page-locking the snapshot slots for asynchronous device-to-host copies (GPU only).

A slot mapping registered with ``cudaHostRegister`` lets ``copy_(non_blocking=True)`` run on the
copy stream at full speed; unregistered, every copy is synchronous. Every CUDA return code is
checked: a failed registration (not enough lockable memory, a container's ``ulimit -l``) is one
clear warning, the error CUDA keeps as its last one is cleared, and training goes on with
synchronous copies. A mapping is registered in pieces of at most ``CHUNK`` bytes (one
registration of 512 GiB or more fails on current drivers), once per address (a rebuilt engine
that maps the same files gets new addresses), and unregistered before it is unmapped.

The CUDA runtime is a seam (``cudart``): tests drive the logic on CPU with a stand-in.
"""

from __future__ import annotations

from megatron_pec.common import log

CHUNK = 64 << 30  # the largest piece registered at once
_REGISTERED: set[int] = set()  # addresses registered in this process


class SlotPinning:
    def __init__(self, cudart, rank: int = 0):
        self.cudart, self.rank = cudart, rank
        self.pinned: list[int] = []
        self.failed: str | None = None
        self._ranges: list[tuple[int, int]] = []

    def pin(self, buffers: list[tuple[int, int]]) -> bool:
        """Register ``(address, length)`` ranges, each in pieces of at most ``CHUNK`` bytes; True
        when all are page-locked."""
        self._ranges = list(buffers)
        for address, length in buffers:
            for start in range(address, address + length, CHUNK):
                if start in _REGISTERED:
                    continue  # never twice: CUDA refuses, and the pair of unregisters would fail
                error = self._call("cudaHostRegister", start, min(CHUNK, address + length - start), 0)
                if error is not None:
                    self._clear_last_error()
                    self.failed = error
                    log.warning(f"cannot page-lock the snapshot slots ({error}); snapshots copy synchronously "
                                "(slower saves). Raise the locked-memory limit (ulimit -l, or the container's "
                                "memlock) to get asynchronous copies back", rank=self.rank)
                    return False
                _REGISTERED.add(start)
                self.pinned.append(start)
        return True

    def device_addressable(self) -> bool:
        """Whether the GPU addresses every pinned range at its host address (CUDA's
        ``canUseHostPointerForRegisteredMem``: so on current x86 Linux systems), so that a kernel can store
        into them; False where the runtime cannot tell."""
        query = getattr(self.cudart, "device_pointer", None)
        if query is None or self.failed is not None:
            return False
        return all(query(start) == start for address, length in self._ranges
                   for start in range(address, address + length, CHUNK))

    def unpin_all(self) -> None:
        """Unregister what this object registered (before the mappings are closed)."""
        for address in self.pinned:
            error = self._call("cudaHostUnregister", address)
            if error is not None:
                self._clear_last_error()
                log.warning(f"cudaHostUnregister failed ({error})", rank=self.rank)
            _REGISTERED.discard(address)
        self.pinned = []

    def _call(self, name: str, *args) -> str | None:
        """None on success, else the error in words."""
        code = getattr(self.cudart, name)(*args)
        value = int(getattr(code, "value", code))
        if value == 0:
            return None
        describe = getattr(self.cudart, "cudaGetErrorString", None)
        text = describe(code) if describe is not None else ""
        return f"{name} returned CUDA error {value}" + (f": {text}" if text else "")

    def _clear_last_error(self) -> None:
        # A failed runtime call stays CUDA's "last error"; the next unrelated check would report it.
        clear = getattr(self.cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()


def slot_ranges(maps) -> list[tuple[int, int]]:
    """(address, length) of each mapped slot."""
    import torch

    return [(torch.frombuffer(m, dtype=torch.uint8).data_ptr(), len(m)) for m in maps]


class TorchCudart:
    """The CUDA runtime calls this module makes: torch's bindings, plus ``cudaGetLastError`` (which
    torch does not bind) from the already loaded libcudart, when it can be found."""

    def __init__(self):
        import torch

        self._rt = torch.cuda.cudart()
        self.cudaHostRegister = self._rt.cudaHostRegister
        self.cudaHostUnregister = self._rt.cudaHostUnregister
        self.cudaGetErrorString = getattr(self._rt, "cudaGetErrorString", None)
        self.cudaGetLastError = _libcudart_get_last_error()

    @staticmethod
    def device_pointer(address: int) -> int | None:
        """The device's address of page-locked host memory at ``address`` (the driver's
        ``cuMemHostGetDevicePointer``), or None where it cannot be asked."""
        import ctypes

        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        out = ctypes.c_uint64()
        if driver.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(address), 0) != 0:
            return None
        return out.value


def _libcudart_get_last_error():
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(ctypes, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return lib.cudaGetLastError
    return None

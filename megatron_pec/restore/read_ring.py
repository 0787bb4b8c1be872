"""Page-locked buffers a rank file passes through on its way into device tensors (load step 6 on a GPU rank,
``restore/landing.py``): each buffer, once the file's bytes are read into it, is copied to the device on a
stream of its own while the next buffer is read.

A file read into one pageable buffer and then copied to the device pays for the copy after the read, at
pageable speed (on the H200, 0.45 s of a 1.5 s restore of 1.8 GB: 14x the copy's floor). Through a ring
of a few page-locked buffers the copies run at the copy engine's speed beside the read, and the host
holds a few buffers of the file, not all of it. The file's CRC-32 is still computed as it is read (the
storage does), and the restore checks the items where they landed, on the device (``Restore._checked_on_device``).

On a host "device" (``MEGATRON_PEC_CHECK_ON_DEVICE=1`` on CPU ranks, the tests) the buffers are plain and
each copy is synchronous: the same path, without a GPU.
"""

from __future__ import annotations

import torch

BUFFERS = 4            # in the ring: one being read, the others' copies in flight
BUFFER_BYTES = 16 << 20  # each: a read's worth (bounded syscalls), a copy long enough for the copy engine


class DeviceReadRing:
    """The ring of buffers through which a restore's file reads reach one device's tensors."""

    def __init__(self, device: torch.device, buffers: int = BUFFERS, buffer_bytes: int = BUFFER_BYTES):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._ring = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(buffers)]
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:  # (built once the targets are allocated: its copies follow that work)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._copied: list = [None] * buffers  # per buffer: a blocking event after its last copy (None: free)
        self._next = 0
        self.copies = 0  # (tests look: copies enqueued)

    @staticmethod
    def for_targets(targets: dict[str, torch.Tensor], host_too: bool = False) -> "DeviceReadRing | None":
        """A staging for the device ``targets`` are on (the first non-host tensor's); with ``host_too``, for the
        host where they are all there (the GPU path on CPU ranks); else None."""
        device = next((t.device for t in targets.values() if t.device.type != "cpu"), None)
        if device is None and host_too and targets:
            device = torch.device("cpu")
        return DeviceReadRing(device) if device is not None else None

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes reach it through this staging (it is on this device)."""
        return tensor.device == self.device

    def through(self, target: torch.Tensor):
        """The buffers to read ``target``'s bytes into (a flat uint8 tensor on this device), in order, as
        ``Storage.read_checked_into``'s pieces: each one, once read (the next one asked for), is copied into
        its place in ``target``. A buffer is handed out again only once its copy is done."""
        size = len(self._ring[0])
        for at in range(0, target.numel(), size):
            n = min(size, target.numel() - at)
            k = self._next
            self._next = (k + 1) % len(self._ring)
            if self._copied[k] is not None:
                self._copied[k].synchronize()  # (blocking: sleeps, no spinning)
            buffer = self._ring[k][:n]
            yield buffer.numpy()
            self._copy(target[at:at + n], buffer, k)

    def _copy(self, destination: torch.Tensor, buffer: torch.Tensor, k: int) -> None:
        self.copies += 1
        if self._stream is None:
            destination.copy_(buffer)
            return
        with torch.cuda.stream(self._stream):
            destination.copy_(buffer, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(self._stream)
        self._copied[k] = event

    def finish(self) -> None:
        """Wait until every copy enqueued has landed (the restore goes on to use the tensors on any stream)."""
        for k, event in enumerate(self._copied):
            if event is not None:
                event.synchronize()
            self._copied[k] = None


__all__ = ["DeviceReadRing", "BUFFERS", "BUFFER_BYTES"]

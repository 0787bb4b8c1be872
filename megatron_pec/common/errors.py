"""User-facing failures: a clear message and a non-zero exit, never a stack trace."""

from megatron_pec.common.log import PREFIX


class CheckpointError(SystemExit):
    """Raised identically on every rank when a checkpoint cannot be saved or loaded as asked.

    A ``SystemExit`` so Megatron's launcher prints the message and exits without a
    traceback; the message says what was wrong and what to do. It carries the package's prefix
    (added here, once).
    """

    def __init__(self, message: str):
        message = message if message.startswith(PREFIX) else f"{PREFIX} {message}"
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ManifestError(ValueError):
    """A manifest or marker that is unreadable or inconsistent (``store/checkpoint_dir.py``)."""


class StorageUnreachable(OSError):
    """The storage cannot be reached now (an object store's endpoint refuses connections or times out): an
    outage that passes, not a refusal of the path. Training goes on from node memory meanwhile; what needs
    the storage is retried or refused with this message. ``PosixStorage`` never raises it (a file system
    that hangs is the kernel's matter)."""

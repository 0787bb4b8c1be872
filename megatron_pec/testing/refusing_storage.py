"""A storage that is down on demand (shipped test tooling): POSIX files, but every ``write`` (rank files,
and the commits that write through it) raises EIO while a marker file exists - a store that refuses, for
as long as a test says.
Plugged in by its description, ``megatron_pec.testing.refusing_storage:RefusingStorage?<marker path>``
(``--pec-storage``), so that the trainers and their node agent meet the same refusals."""

from __future__ import annotations

import errno
import os

from megatron_pec.store.storage import PosixStorage, spec_argument


class RefusingStorage(PosixStorage):
    def __init__(self, spec: str):
        self.spec, self.marker = spec, spec_argument(spec, "the marker file's path")

    def write(self, path, chunks):
        if os.path.exists(self.marker):
            raise OSError(errno.EIO, f"the storage is down (while {self.marker} exists)", path)
        return super().write(path, chunks)


__all__ = ["RefusingStorage"]

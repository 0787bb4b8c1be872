"""A storage that records what goes through it (shipped test tooling): POSIX files, and one line per
write, create, commit and delete appended to a log. Plugged in by its description,
``megatron_pec.testing.recording_storage:RecordingStorage?<log path>`` (``--pec-storage``), so that a
test sees which process - the trainer, the node agent, a command - wrote what through the job's storage.
"""

from __future__ import annotations

import json
import os

from megatron_pec.store.storage import PosixStorage, spec_argument


class RecordingStorage(PosixStorage):
    def __init__(self, spec: str):
        self.spec, self.log = spec, spec_argument(spec, "the log's path")

    def _record(self, op: str, path: str, **extra) -> None:
        line = json.dumps({"pid": os.getpid(), "op": op, "path": path, **extra}) + "\n"
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # (one write: lines never mix)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def write(self, path, chunks):
        size, crc = super().write(path, chunks)
        self._record("write", path, size=size)
        return size, crc

    def create(self, path, data):
        created = super().create(path, data)
        self._record("create", path, created=created)
        return created

    def commit(self, path, data, expected):
        committed = super().commit(path, data, expected)
        self._record("commit", path, committed=committed)
        return committed

    def delete(self, path):
        super().delete(path)
        self._record("delete", path)

    def delete_prefix(self, prefix):
        super().delete_prefix(prefix)
        self._record("delete_prefix", prefix)


def read_log(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


__all__ = ["RecordingStorage", "read_log"]

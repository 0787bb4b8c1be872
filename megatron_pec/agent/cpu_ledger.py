"""The agent's CPU time by what it was doing: the benchmarks' breakdown of what persisting costs.

Each part of the agent's work (``with ledger("committing"): ...``) is charged the CPU time of the
thread that does it (the worker, the writer, the writer's checksum thread: they run at once, so
process time would count one part's time in another's); the ledger is written to
``<node dir>/agent_cpu.json`` when a trainer flushes. The agent's whole CPU time is in it too: the
rest (serving messages, replication's threads) is the difference.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

from megatron_pec.common import log
from megatron_pec.memory.node_files import replace_node_file

FILE = "agent_cpu.json"


class CpuLedger:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, FILE)
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, name: str):
        started = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - started
            with self._lock:
                self.seconds[name] = self.seconds.get(name, 0.0) + spent

    def write(self) -> None:
        """The ledger and the process's CPU seconds so far, replaced atomically (node memory is tmpfs); a
        failure is one log line (only the benchmarks read it)."""
        with self._lock:
            phases = dict(self.seconds)
        try:
            replace_node_file(self.path, json.dumps({"phases": phases, "process_s": time.process_time()}))
        except OSError as exc:
            log.info(f"cannot write {self.path}: {exc}")


def read_ledger(directory: str) -> dict | None:
    """What the node agent of ``directory`` wrote at the last flush (None: nothing yet)."""
    try:
        with open(os.path.join(directory, FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("phases"), dict) else None


__all__ = ["CpuLedger", "read_ledger", "FILE"]

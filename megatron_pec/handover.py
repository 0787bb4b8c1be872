"""Phase 4, notify: a snapshot goes to the node agent as soon as its bytes are in node memory.

When copies run asynchronously (GPU; ``MEGATRON_PEC_DEFER_SNAPSHOT=1`` runs the same path on CPU)
a watcher thread waits for each snapshot's copies, then completes it (slot header, announcement):
a trainer killed right after a save still leaves that snapshot to the agent. Otherwise the caller
completes it at once. Either way snapshots complete in the order they were taken.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

from megatron_pec import log
from megatron_pec.protocol import SlotHeader
from megatron_pec.stager import StagedCopy


@dataclass(frozen=True)
class PendingSnapshot:
    """A snapshot whose copies may still be running: what completing it needs."""

    slot: int                        # its home: header and dense state
    iteration: int
    persistent: bool
    persist_items: list[str] | None  # experts to persist besides the dense state (None: all it wrote)
    placement: dict[str, int]        # item -> the slot it was copied into (the header's is ``slot``)
    header: SlotHeader
    staged: StagedCopy
    generation: str = ""             # a persistent save's (``manifest``)


class HandOver:
    def __init__(self, complete: Callable[[PendingSnapshot], None], background: bool):
        self._complete = complete
        self._latest: PendingSnapshot | None = None  # the newest one submitted (its copies guard the next step)
        self._queue: queue.Queue | None = queue.Queue() if background else None
        if self._queue is not None:
            threading.Thread(target=self._watch, name="megatron-pec hand-over", daemon=True).start()

    @property
    def background(self) -> bool:
        return self._queue is not None

    def submit(self, pending: PendingSnapshot) -> None:
        self._latest = pending
        if self._queue is None:
            self._complete(pending)
        else:
            self._queue.put(pending)

    def wait(self) -> None:
        """Until every submitted snapshot is complete."""
        if self._queue is not None:
            self._queue.join()

    def before_step(self, stream) -> None:
        """The optimizer step about to run (on ``stream``) must not change what is still being copied."""
        if self._latest is not None:
            self._latest.staged.before(stream)

    def _watch(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                pending.staged.wait()  # (releases the GIL: training goes on meanwhile)
                self._complete(pending)
            except Exception as exc:  # that snapshot is lost, not the ones after it
                log.warning(f"the snapshot of iteration {pending.iteration} could not be handed to the node agent: "
                            f"{type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

"""Save step 4, describe and hand over (its hand-over): a snapshot goes to the node agent as soon as its
bytes are in node memory.

A watcher thread completes each snapshot off the training thread: it waits for the copies (GPU), reads
the items' checksums (on the GPU computed by the device; on CPU ranks summed over the slot, numpy, the
GIL released), writes the slot header and announces the snapshot. Snapshots complete in the order they
were taken, and each before the next optimizer step can change what it is made of: on the GPU that
step's stream waits for the copies (the host does not), on CPU ranks the step waits for the hand-over
itself, so a trainer killed in the next step still leaves the snapshot to the agent.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from megatron_pec.common import log
from megatron_pec.format.protocol import SlotHeader
from megatron_pec.format.small_state_record import Captured
from megatron_pec.save.stager import StagedCopy


@dataclass(frozen=True)
class PendingSnapshot:
    """A snapshot whose copies may still be running: what completing it needs."""

    slot: int                        # its home: header and dense state
    iteration: int
    persistent: bool
    persist_items: list[str] | None  # experts to persist besides the dense state (None: all it wrote)
    placement: dict[str, int]        # item -> the slot it was copied into (the header's is ``slot``)
    header: SlotHeader               # (its small state still to be encoded: ``small``)
    small: Captured
    staged: StagedCopy
    generation: str = ""             # a persistent save's (``manifest``)
    known_sums: dict = field(default_factory=dict)  # checksums of items earlier rounds wrote (every expert in rounds)


@dataclass(frozen=True)
class AgreedLater:
    """A save whose copies are enqueued and whose agreement's result the hand-over reads (``Save.take``'s
    ``agree_later``): then it is described, or skipped."""

    save: object                     # ``save.Save``
    staged: StagedCopy | None        # None: nothing was copied (this rank had no slot)
    small: Captured
    generation: str

    @property
    def iteration(self) -> int:
        return self.save.iteration


class HandOver:
    def __init__(self, complete: Callable[[PendingSnapshot], None]):
        self._complete = complete
        # the newest one submitted (its copies guard the next step)
        self._latest: PendingSnapshot | AgreedLater | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._watch, name="megatron-pec hand-over", daemon=True)
        self._thread.start()

    def submit(self, pending: PendingSnapshot | AgreedLater) -> None:
        self._latest = pending
        self._queue.put(pending)

    def wait(self) -> None:
        """Until every submitted snapshot is complete (on the hand-over thread itself: at once, its work is
        in order by construction)."""
        if threading.current_thread() is not self._thread:
            self._queue.join()

    def before_step(self, stream) -> None:
        """The optimizer step about to run (on ``stream``; None: CPU ranks) must not change what is still
        being copied, and on CPU ranks waits for the hand-over (normally long done by then)."""
        if self._latest is None:
            return
        if stream is None:
            self.wait()
        elif self._latest.staged is not None:
            self._latest.staged.before(stream)

    def _watch(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                if pending.staged is not None:
                    pending.staged.wait()  # (releases the GIL: training goes on meanwhile)
                self._complete(pending)
            except Exception as exc:  # that snapshot is lost, not the ones after it
                log.warning(f"the snapshot of iteration {pending.iteration} could not be handed to the node agent: "
                            f"{type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

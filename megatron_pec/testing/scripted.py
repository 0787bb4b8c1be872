"""A trainer speaking the node agent's protocol without Megatron: the test suite's and the agent
benchmark's stand-in for the engine (shipped test tooling; production code never imports it).

It fills its regions with known values (``iteration + 0.5``) through the same ``SlotFiles`` and
``RegionBook`` the engine uses, sums them as the trainer does on the CPU and announces them.
"""

from __future__ import annotations

import time
from dataclasses import replace

from megatron_pec.agent.client import AgentClient, ensure_agent
from megatron_pec.agent.link import WRITE_WAIT_S
from megatron_pec.format.protocol import (
    Begin,
    Begun,
    Granted,
    Hello,
    JobInfo,
    Released,
    SlotHeader,
    SnapshotReady,
    Stop,
)
from megatron_pec.integrity.sum64 import item_sums
from megatron_pec.memory.history import NodeMemory
from megatron_pec.memory.regions import RegionBook
from megatron_pec.memory.slot_map import SlotMap
from megatron_pec.memory.slots import SlotFiles


class ScriptedTrainer:
    """One rank speaking the agent protocol as the engine does: hello, begin, snapshots into the regions
    its ``RegionBook`` chooses, each item's checksum in the header (as the trainer computes them).
    ``entries``: the slot layout (``stformat.layout``); ``items``: its items, in slot order."""

    def __init__(self, directory, rank, root, entries, items, nodes=2, keep=0, job="t", run="run-1",
                 resumed_from=None, replicas=0, fingerprint="f", regions=None, node=None, local_ranks=1, storage=""):
        """``regions``: the expert pool's (default: two per expert, what every-expert snapshots take);
        ``node``: the node's rank (default: the rank, one rank a node), of ``local_ranks`` ranks;
        ``storage``: the job's storage description (``--pec-storage``; "": POSIX)."""
        self.directory, self.rank, self.root, self.run, self.items = directory, rank, root, run, tuple(items)
        node = rank if node is None else node
        self.job = JobInfo(job_id=job, fingerprint=fingerprint, save=root, local_world_size=local_ranks,
                           node_rank=node, num_nodes=nodes, topology={"ep": 2}, keep=keep, replicas=replicas,
                           storage=storage)
        ensure_agent(directory, node, idle_timeout=60, keep_shm=False)
        layout = SlotMap.of(entries, 0, homes=3 if nodes > 1 and not replicas else 2)
        self.files = SlotFiles(directory, rank, replace(layout, regions=regions if regions is not None
                                                        else 2 * len(layout.experts)), local_ranks)
        self.client = AgentClient(directory, rank)
        self.client.connect(Hello(rank, self.job))
        self.book = RegionBook(list(self.items), self.files.layout.regions, self.files.layout.homes)
        self.waits = 0  # snapshots that found no home within the engine's wait (it would skip a memory-only one)
        self.waited_s = 0.0  # the longest a snapshot waited for a home
        self.begin(run, resumed_from)

    def begin(self, run, resumed_from):
        self.run = run
        answer, _ = self.client.request(Begin(run, resumed_from), Begun, timeout=30)
        self.book.reset(NodeMemory.read(self.directory), self.rank)
        self.book.pin(answer.pins, answer.hold)
        return answer

    def write(self, iteration, written=None):
        """Copy ``written`` (default: every item) at ``iteration`` into the regions the book chooses;
        (home, placement)."""
        written = self.items if written is None else written
        home = self.wait_for_home()
        assert home is not None, "no region free for some item"
        placement = self.book.place(home, written)
        self.book.writing(iteration, placement)
        for item, slot in placement.items():
            for view in self.files.item_views(slot, item).values():
                view.fill_(iteration + 0.5)
        return home, placement

    def snapshot(self, iteration, persist_items=None, written=None, persist=True, wait=True, legacy=False):
        """Write ``written`` items at ``iteration``, announce, wait for the release (``wait=False``: return
        (home, placement) at once); ``legacy``: a header without checksums (an older trainer)."""
        written = self.items if written is None else written
        home, placement = self.write(iteration, written)
        sums = {}
        for item, slot in placement.items():
            sums.update(item_sums(self.files.mapping(slot), self.files.item_header(slot, item), {item}))
        header = SlotHeader(job_id=self.job.job_id, fingerprint=self.job.fingerprint, save=self.root, rank=self.rank,
                            world_size=2, iteration=iteration, items=dict.fromkeys(written, iteration),
                            tokens={i: 100 * iteration + n
                                    for n, i in enumerate(e for e in self.items if e != "dense")},
                            small="{}", pec="{}", run=self.run, sums={} if legacy else sums)
        self.files.write_header(home, header.to_metadata())
        places = {i: s for i, s in placement.items() if s != home}
        stale = self.book.announced(iteration, placement)
        assert self.client.send(SnapshotReady(home, iteration, persist, persist_items, places, stale))
        if not wait:
            return home, placement
        return (home, placement), self.released(iteration)

    def wait_for_home(self, timeout: float = 30.0):
        """A home slot for the next snapshot, waiting (up to ``timeout``) for the agent to hand one back
        (a write reading the other one), as a persistent save of the engine waits. Counts in ``waits`` a
        snapshot that found none within the engine's wait for a write (it would skip a memory-only one)
        and in ``waited_s`` the longest wait."""
        started = time.monotonic()
        while self.book.home() is None and time.monotonic() < started + timeout:
            for msg in self.client.poll(block_s=0.05):
                self.hear(msg)
        waited = time.monotonic() - started
        self.waited_s = max(self.waited_s, waited)
        self.waits += waited > WRITE_WAIT_S or self.book.home() is None
        return self.book.home()

    def hear_until(self, done, timeout: float = 30.0) -> bool:
        """Hear the agent's messages until ``done()`` holds (True) or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                return False
            for msg in self.client.poll(block_s=0.2):
                self.hear(msg)
        return True

    def released(self, iteration):
        """The agent's last answer to snapshot ``iteration`` (a persistent one's: once it is written)."""
        for _ in range(150):
            for msg in self.client.poll(block_s=0.2):
                self.hear(msg)
                if isinstance(msg, Released) and msg.iteration == iteration and not msg.persisting:
                    return msg
        raise AssertionError("no release from the agent")

    def hear(self, msg):
        if isinstance(msg, Released) and not msg.written:
            self.book.released(msg.iteration, msg.recorded)
        if isinstance(msg, (Released, Granted)):
            self.book.pin(msg.pins, msg.hold)

    def memory(self):
        return NodeMemory.read(self.directory)

    def close(self):
        self.files.close()
        self.client.send(Stop())


__all__ = ["ScriptedTrainer"]

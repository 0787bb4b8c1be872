
"""The trainer's session with a real node agent: its messages read and handled by the session's listener
thread, never on the thread that leases (the training thread), and a lost agent noticed without a call."""

import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch

from megatron_pec.agent import client as client_module
from megatron_pec.agent.link import AgentLink
from megatron_pec.format.protocol import Hello, JobInfo, SlotHeader
from megatron_pec.format.stformat import layout
from megatron_pec.integrity.sum64 import item_sums
from megatron_pec.memory.slot_map import SlotMap
from megatron_pec.memory.slots import SlotFiles, node_dir

pytestmark = pytest.mark.megatron_free

ENTRIES = layout([("dense/w.param", torch.float32, 256)]
                 + [(f"L1.E{e}/w.{k}", torch.float32, 128) for e in range(2) for k in ("param", "exp_avg")])
ITEMS = ["dense", "L1.E0", "L1.E1"]


def _session(shm_dir, root):
    directory = node_dir(shm_dir, "s", 0)
    job = JobInfo(job_id="s", fingerprint="f", save=root, local_world_size=1, node_rank=0, num_nodes=1,
                  topology={"ep": 1}, keep=0, replicas=0, storage="")
    plan = SlotMap.of(ENTRIES, 0, homes=2)
    files = SlotFiles(directory, 0, replace(plan, regions=2 * len(plan.experts)), 1)
    session = AgentLink(directory, 0, 0, Hello(0, job), ITEMS, idle_timeout=60, keep_shm=False,
                        wait_for_slot=False)
    session.use_pool(files.layout.regions, files.layout.homes)
    session.start()
    return session, files


def _snapshot(session, files, iteration):
    home, why = session.lease(False)
    assert home is not None, why
    placement = session.place(home, ITEMS)
    session.writing(iteration, placement)
    sums = {}
    for item, slot in placement.items():
        for view in files.item_views(slot, item).values():
            view.fill_(iteration + 0.5)
        sums.update(item_sums(files.mapping(slot), files.item_header(slot, item), {item}))
    header = SlotHeader(job_id="s", fingerprint="f", save=session.hello.job.save, rank=0, world_size=1,
                        iteration=iteration,
                        items=dict.fromkeys(ITEMS, iteration), tokens={"L1.E0": 1, "L1.E1": 2}, small="{}", pec="{}",
                        run=session.run, sums=sums)
    files.write_header(home, header.to_metadata())
    assert session.announce(home, iteration, False, None, placement)


def _until(done, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_listener_handles_the_agents_answers_off_the_leasing_thread(shm_dir, tmp_path, monkeypatch):
    decoded_on = []
    decode = client_module.decode_message
    monkeypatch.setattr(client_module, "decode_message",
                        lambda line: (decoded_on.append(threading.current_thread()), decode(line))[1])
    session, files = _session(shm_dir, str(tmp_path / "ckpt"))
    try:
        session.begin(None)
        for iteration in (1, 2, 3):
            _snapshot(session, files, iteration)
            # recorded and handed back with no call into the session: its listener heard the agent
            _until(lambda: not session.regions.pending)
        session.flush()  # answered through the listener too
        assert decoded_on and threading.main_thread() not in decoded_on[1:]  # (the first: connect's handshake)
    finally:
        session.close(detach=True)
        files.close()
    assert session._listener is not None and not session._listener.is_alive()


def test_a_killed_agent_is_noticed_by_the_listener_and_the_next_lease_reconnects(shm_dir, tmp_path):
    session, files = _session(shm_dir, str(tmp_path / "ckpt"))
    try:
        session.begin(None)
        _snapshot(session, files, 1)
        _until(lambda: not session.regions.pending)
        first = session.agent_pid
        os.kill(first, signal.SIGKILL)
        _until(lambda: not session.connected)  # no call into the session meanwhile
        _snapshot(session, files, 2)  # the lease starts a new agent and says the timeline again
        assert session.connected and session.agent_pid != first
        _until(lambda: not session.regions.pending)
        session.settle()
    finally:
        session.close(detach=True)
        files.close()


def test_the_listener_reads_a_connection_beyond_selects_1024_descriptors(shm_dir, tmp_path):
    """A training process may hold thousands of descriptors (sockets to every rank, data loaders): the
    agent's connection is then numbered above 1024, where ``select`` cannot wait on it."""
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        session, files = _session(shm_dir, str(tmp_path / "ckpt"))
        try:
            assert session.client.sock.fileno() > 1024
            session.begin(None)
            _snapshot(session, files, 1)
            _until(lambda: not session.regions.pending)
            assert session.connected
        finally:
            session.close(detach=True)
            files.close()
    finally:
        for fd in held:
            os.close(fd)


def test_a_settled_connection_settles_on_its_own_snapshots_without_a_round_trip(shm_dir, tmp_path):
    """A restore's settle asks the agent the first time on a connection (a pull from peers may be under way);
    after that it waits only for this trainer's own snapshots to be recorded, which their Released says
    (the agent writes its index first): the index then lists every snapshot announced, with no message sent."""
    from megatron_pec.memory.history import NodeMemory

    session, files = _session(shm_dir, str(tmp_path / "ckpt"))
    sent = []
    send = session.client.send
    session.client.send = lambda msg: (sent.append(type(msg).__name__), send(msg))[1]
    try:
        session.begin(None)
        session.settle()
        assert sent.count("Settle") == 1
        for iteration in (1, 2, 3):
            _snapshot(session, files, iteration)
            session.settle()  # (right after the announcement: the snapshot is still pending)
            assert max(r.iteration for r in NodeMemory.read(session.node_dir).slots[0].values()) == iteration
        assert sent.count("Settle") == 1 and not session.persist_errors, sent
    finally:
        session.close(detach=True)
        files.close()

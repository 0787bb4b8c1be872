"""The wire to the node agent, trainer side: start or reuse the agent, send and receive its messages.

Every rank holds one connection to its node's agent (``link.AgentLink`` speaks the
protocol over it). Any rank that finds no live agent starts one (under a lock, so a node gets
exactly one), detached in its own session so it survives the trainer's SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time

from megatron_pec.common import log
from megatron_pec.format.protocol import Detach, Hello, ProtocolError, Ready, Record, decode_message
from megatron_pec.memory.node_files import AGENT_LOG, PIDFILE, SOCKET, agent_lock


class AgentUnavailable(RuntimeError):
    """The node agent could not be started or reached."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def agent_pid(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, PIDFILE)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


MAX_SOCKET_PATH = 107  # bytes in a Unix socket address (sun_path) on Linux, without the final NUL


def check_socket_path(directory: str) -> None:
    """Raise AgentUnavailable, before anything starts, if the agent's socket address is too long."""
    path = os.path.join(os.path.abspath(directory), SOCKET)
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise AgentUnavailable(
            f"the node agent's socket {path} is {len(path.encode())} bytes long, but Unix sockets allow "
            f"{MAX_SOCKET_PATH}: use a shorter --pec-shm-dir or --pec-job-id")


def ensure_agent(directory: str, node_rank: int, idle_timeout: float, keep_shm: bool,
                 timeout: float = 60.0) -> int:
    """Return the pid of this node's agent, starting one if none is alive."""
    os.makedirs(directory, exist_ok=True)
    with agent_lock(directory):
        pid = agent_pid(directory)
        if pid is not None and _connectable(directory):
            return pid
        log_path = os.path.join(directory, AGENT_LOG)
        env = dict(os.environ, MEGATRON_PEC_NODE_RANK=str(node_rank))
        env.pop("RANK", None)  # the agent's fault points are scoped by node, not by rank
        with open(log_path, "a") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "megatron_pec", "agent", "--dir", directory, "--node-rank", str(node_rank),
                 "--idle-timeout", str(idle_timeout)] + (["--keep-shm"] if keep_shm else []),
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True, env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                raise AgentUnavailable(f"the node agent exited with code {code} while starting; see {log_path}")
            if agent_pid(directory) == proc.pid and _connectable(directory):
                return proc.pid
            time.sleep(0.05)
        proc.kill()
        raise AgentUnavailable(f"the node agent did not start within {timeout:.0f}s; see {log_path}")


def _connectable(directory: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(os.path.join(directory, SOCKET))
        return True
    except OSError:
        return False


class AgentClient:
    """One rank's connection; ``send`` and ``poll`` never block on the agent's work."""

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, rank
        self.sock: socket.socket | None = None
        self.buffer = b""
        self.inbox: list[Record] = []  # received while waiting for an answer, not yet polled
        self.pid: int | None = None

    def connect(self, hello: Hello, timeout: float = 30.0) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        self.buffer, self.inbox = b"", []
        try:
            sock.connect(os.path.join(self.directory, SOCKET))
            sock.sendall((hello.dumps() + "\n").encode())
            reply = self._read_line(sock)
        except (OSError, ProtocolError) as exc:
            sock.close()
            raise AgentUnavailable(f"cannot reach the node agent at {self.directory}: {exc}") from None
        if not isinstance(reply, Ready):
            sock.close()
            raise AgentUnavailable(f"the node agent at {self.directory} did not answer the handshake")
        self.sock, self.pid = sock, reply.pid

    def _read_line(self, sock) -> Record | None:
        while b"\n" not in self.buffer:
            data = sock.recv(65536)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return decode_message(line)

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def send(self, msg: Record) -> bool:
        """False (and disconnected) when the agent is gone."""
        if self.sock is None:
            return False
        try:
            self.sock.settimeout(30.0)
            self.sock.sendall((msg.dumps() + "\n").encode())
            return True
        except OSError:
            self._lost()
            return False

    def poll(self, block_s: float = 0.0) -> list[Record]:
        """Messages from the agent that have arrived (waiting up to ``block_s`` for the first)."""
        if self.inbox:
            out, self.inbox = self.inbox, []
            return out
        if self.sock is None:
            return []
        self.sock.settimeout(block_s)  # 0.0 = non-blocking
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    self._lost()
                    break
                self.buffer += data
                self.sock.settimeout(0.0)
        except (BlockingIOError, socket.timeout):
            pass
        except OSError:
            self._lost()
        return self._decoded()

    def receive(self, wait_s: float) -> list[Record]:
        """Messages from the agent, waiting up to ``wait_s`` for some: for one reader thread while others
        send (the socket's timeout, which its sends use, is left alone; a closed socket ends the wait).
        ``poll``, not ``select``: a training process may hold more than select's 1024 descriptors."""
        sock = self.sock
        if sock is None:
            return []
        try:
            ready = select.poll()
            ready.register(sock, select.POLLIN)
            if ready.poll(wait_s * 1000):
                data = sock.recv(65536)
                if not data:
                    self._lost(sock)
                    return []
                if sock is not self.sock:
                    return []  # (replaced meanwhile: the new connection's buffer is not this one's)
                self.buffer += data
        except (OSError, ValueError):  # (ValueError: closed by another thread meanwhile)
            self._lost(sock)
            return []
        return self._decoded()

    def _decoded(self) -> list[Record]:
        """The complete lines received so far, decoded (an undecodable one: the connection is dropped)."""
        out = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                out.append(decode_message(line))
            except ProtocolError as exc:  # an agent of another megatron-pec version: stop talking to it
                log.warning(f"the node agent at {self.directory} sent a message this trainer cannot read ({exc})",
                            rank=self.rank)
                self._lost()
                break
        return out

    def request(self, msg: Record, answer: type, timeout: float) -> tuple[Record | None, list[Record]]:
        """Send ``msg`` and wait for the first message of type ``answer``; returns it (None if the
        agent died or did not answer in time) and every other message that arrived meanwhile."""
        if not self.send(msg):
            return None, []
        others, deadline = [], time.monotonic() + timeout
        while self.connected and time.monotonic() < deadline:
            messages = self.poll(block_s=0.5)
            for i, received in enumerate(messages):
                if isinstance(received, answer):
                    self.inbox = messages[i + 1:]
                    return received, others
                others.append(received)
        return None, others

    def _lost(self, sock: socket.socket | None = None) -> None:
        """The connection broke (``sock``: the one a reader found broken; a close or a reconnect since then
        replaced it, and nothing is lost)."""
        sock = sock or self.sock
        if sock is None or sock is not self.sock:
            return
        self.sock = None
        sock.close()
        log.warning(f"lost the node agent (pid {self.pid}) at {self.directory}; snapshots are skipped until a new "
                    "agent runs", rank=self.rank)

    def close(self, detach: bool = True) -> None:
        if detach:
            self.send(Detach())
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a reader waiting on it)
            sock.close()

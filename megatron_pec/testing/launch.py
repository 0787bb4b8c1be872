"""One launcher for every test, harness, benchmark and example: the ``torchrun`` command line, master
ports two launches never share, and stopping the node agents a job left running.

Runs in driver processes (tests, ``cluster.py``, ``benchmarks/``, ``examples/``), never inside training;
production code does not import it. A launch is data (``Launch``): what runs, on how many processes,
with which torchrun options; variants are copies with fields replaced (``dataclasses.replace``).

* ``command(launch, port)``: the argv of ``python -m torch.distributed.run`` for it;
* ``run(launch, ...)`` / ``start(launch, ...)``: ``subprocess.run`` / ``Popen`` of it on a port ``free_port``
  reserved (``port=`` for the nodes of one multi-node job, which share theirs);
* ``free_port()``: a master port nothing listens on and no other launcher handed out in the last minute;
* ``stop_agents(root)``: every node agent serving a node directory under ``root``, found by its pid file
  and by its command line (a deleted pid file hides none), signalled and waited for.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_pec.memory.node_files import PIDFILE

PORTS = range(29500, 30000)  # the master ports every launch of this repository draws from
PORT_HOLD_S = 60.0  # how long a port handed out stays reserved for the launch that asked (it binds it by then)


@dataclass(frozen=True)
class Launch:
    """One ``torchrun`` launch. ``target`` is a script path, or a module with ``module=True``; ``options``
    are further torchrun options (``--log-dir``, ``--redirects``, ``--rdzv-id``, ``--max-restarts``)."""

    target: str | os.PathLike
    args: tuple[str, ...] = ()
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    module: bool = False
    options: tuple[str, ...] = ()


def command(launch: Launch, port: int) -> list[str]:
    """The argv that starts ``launch`` with its master on 127.0.0.1:``port``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(launch.nproc)]
    if launch.nnodes > 1:
        cmd += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), *launch.options]
    cmd += ["-m", str(launch.target)] if launch.module else [str(launch.target)]
    return cmd + [str(a) for a in launch.args]


def run(launch: Launch, *, port: int | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` of ``launch`` (keywords as there: env, cwd, timeout, capture_output, ...)."""
    return subprocess.run(command(launch, port or free_port()), **kwargs)


def start(launch: Launch, *, port: int | None = None, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` of ``launch`` (keywords as there)."""
    return subprocess.Popen(command(launch, port or free_port()), **kwargs)


def free_port(start: int | None = None) -> int:
    """A master port in ``PORTS`` that nothing listens on (or lingers on) right now and that no other
    process of this repository handed out in the last ``PORT_HOLD_S``: two launchers (a test run beside a
    campaign or a benchmark) would otherwise pick the same free port at once and one launch fail to bind."""
    offset = (start if start is not None else os.getpid() * 7 + int(time.monotonic() * 1000)) % len(PORTS)
    reservations = Path(tempfile.gettempdir()) / "megatron_pec_ports"
    reservations.mkdir(exist_ok=True)
    for i in range(len(PORTS)):
        port = PORTS[(offset + i) % len(PORTS)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _reserve(reservations / str(port)):
            return port
    raise RuntimeError(f"no free master port in {PORTS.start}-{PORTS.stop - 1}")


def _reserve(path: Path) -> bool:
    try:
        if time.time() - path.stat().st_mtime < PORT_HOLD_S:
            return False
        path.unlink()
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False  # another process reserved it just now


# ---- node agents ---------------------------------------------------------------------------------

def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _agent_dir(pid: int) -> str | None:
    """The node directory agent ``pid`` serves (its ``--dir``), None if ``pid`` is no node agent."""
    argv = _cmdline(pid)
    if "megatron_pec" not in argv or "agent" not in argv or "--dir" not in argv[:-1]:
        return None
    return os.path.realpath(argv[argv.index("--dir") + 1])


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def agent_pid(node_dir: str | os.PathLike) -> int | None:
    """The living agent of ``node_dir`` its pid file names (checked: a stale pid file may name a reused pid)."""
    try:
        pid = int((Path(node_dir) / PIDFILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) and _agent_dir(pid) == os.path.realpath(node_dir) else None


def agents(root: str | os.PathLike) -> list[int]:
    """Living node agents serving ``root`` or a directory under it: the pid files of ``root`` (a node
    directory), ``root/*/`` and ``root/<job>/node*/``, and any process whose command line says so."""
    root = os.path.realpath(root)
    found = {pid for pattern in (PIDFILE, f"*/{PIDFILE}", f"*/*/{PIDFILE}")
             for pidfile in Path(root).glob(pattern) if (pid := agent_pid(pidfile.parent)) is not None}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            served = _agent_dir(int(name))
            if served is not None and _under(served, root) and _alive(int(name)):
                found.add(int(name))
    return sorted(found)


def stop_agents(root: str | os.PathLike, sig: int = signal.SIGKILL, grace_s: float = 0.0,
                timeout_s: float = 10.0) -> list[int]:
    """Stop every node agent serving ``root`` or a directory under it; returns their pids.

    ``grace_s``: first wait that long for them to exit by themselves (after their trainers detached);
    ``sig``: SIGKILL (a lost node, a test's clean-up) or SIGTERM (the agent's own clean shutdown, which
    removes its slots). Waits up to ``timeout_s`` until they are gone."""
    deadline = time.monotonic() + grace_s
    while (pids := agents(root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


__all__ = ["Launch", "command", "run", "start", "free_port", "agent_pid", "agents", "stop_agents", "PORTS"]

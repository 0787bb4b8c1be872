"""Deterministic fault-injection points, off and free by default.

A test hook by design, armed from the environment: besides ``config.py`` (the one configuration) the
only module that reads it, because its variables must reach every process of a test - trainers and
the node agents they start, which never build a ``PecConfig`` - and must cost nothing when unset.

``MEGATRON_PEC_FAULT`` arms points, comma-separated, each ``point=action[@n][:rank]``:
``action`` is ``kill`` (SIGKILL this process), ``enospc`` or ``eio`` (raise that
OSError) or ``stall`` (sleep ``MEGATRON_PEC_FAULT_STALL_S``, default 3 s: slow storage, a
stuck write, a rank held at a known point); ``@n`` fires on
the n-th time the point is reached (default 1);
``:rank`` limits it to one global rank (trainer points) or node (agent points).
When the variable is unset, ``point()`` is a single dictionary lookup on an
empty dict.

Points: trainer ``snapshot_begin``, ``snapshot_mid``, ``snapshot_end``,
``optimizer_step``; agent ``agent_recorded`` (a snapshot recorded in node memory, not yet
released to its trainer), ``replica_receive`` (a peer's snapshot partly received), ``persist_write``
(mid file), ``before_rename``, ``before_node_marker``, ``before_manifest``,
``before_tracker``.

``MEGATRON_PEC_FAULT_ONCE=DIR`` makes every armed point fire at most once across
all processes that share ``DIR`` (a marker file per point, created with O_EXCL):
a node agent restarted after an injected kill inherits the trainer's
environment and would otherwise fire the same fault again.

The random fault campaign that drives these points lives with the test tooling:
``python -m megatron_pec.testing.campaign --runs N``.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

_ACTIONS = {"kill", "enospc", "eio", "stall"}
STALL_S = float(os.environ.get("MEGATRON_PEC_FAULT_STALL_S", "3"))


def _parse(spec: str) -> dict[str, list]:
    armed: dict[str, list] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            name, action = part.split("=", 1)
            scope = None
            if ":" in action:
                action, scope = action.split(":", 1)
            count = 1
            if "@" in action:
                action, n = action.split("@", 1)
                count = int(n)
            if action not in _ACTIONS:
                raise ValueError
        except ValueError:
            raise SystemExit(f"MEGATRON_PEC_FAULT: cannot parse {part!r}; expected "
                             "point=kill|enospc|eio|stall[@n][:rank]") from None
        armed[name] = [action, count, scope]
    return armed


_ARMED = _parse(os.environ.get("MEGATRON_PEC_FAULT", ""))
_SCOPE = os.environ.get("RANK") or os.environ.get("MEGATRON_PEC_NODE_RANK")


def point(name: str, **context) -> None:
    """Fire the fault armed for ``name``, if any (see module docstring)."""
    if not _ARMED:
        return
    armed = _ARMED.get(name)
    if armed is None:
        return
    action, count, scope = armed
    if scope is not None and scope != os.environ.get("MEGATRON_PEC_FAULT_SCOPE", _SCOPE):
        return
    armed[1] = count - 1
    if armed[1] > 0:
        return
    del _ARMED[name]
    once = os.environ.get("MEGATRON_PEC_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(os.path.join(once, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another process already fired it
    print(f"megatron-pec fault injection: {action} at {name} {context or ''}", file=sys.stderr, flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "stall":
        time.sleep(STALL_S)
        return
    code = errno.ENOSPC if action == "enospc" else errno.EIO
    raise OSError(code, f"injected {action.upper()} at {name}", context.get("path"))


"""One logger for the whole package: ``logging.getLogger("megatron_pec")``.

Its formatter owns the prefix: a trainer's lines read ``megatron-pec: [WARNING ][rank R: ]message``,
the node agent's ``[megatron-pec agent PID] message`` (``use_agent_prefix``). Information goes to
stdout and warnings to stderr, each line flushed (training logs interleave processes). The streams
are looked up at every line, so a caller that swaps ``sys.stdout`` (pytest) still sees them.
Messages that should appear once per process pass ``once=True``; ``rank0=True`` keeps a line to
global rank 0 (``set_rank``).

Not ``warnings.warn``: training scripts often run with ``PYTHONWARNINGS=ignore``, and a skipped
snapshot or an ignored flag must still be seen. The logger does not propagate to the root logger,
so a training script's own logging configuration neither doubles nor swallows these lines.
"""

from __future__ import annotations

import logging
import os
import sys

PREFIX = "megatron-pec:"
LOGGER = logging.getLogger("megatron_pec")

__all__ = ["LOGGER", "PREFIX", "info", "warning", "set_rank", "use_agent_prefix"]


class _Formatter(logging.Formatter):
    def __init__(self):
        super().__init__()
        self.agent_pid: int | None = None  # set in the node agent process

    def as_agent(self, pid: int) -> None:
        self.agent_pid = pid

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if self.agent_pid is not None:
            return f"[megatron-pec agent {self.agent_pid}] {message}"
        level = "WARNING " if record.levelno >= logging.WARNING else ""
        rank = getattr(record, "rank", None)
        return f"{PREFIX} {level}{f'rank {rank}: ' if rank is not None else ''}{message}"


class _Filter(logging.Filter):
    """Drops repeats of ``once`` lines and ``rank0`` lines of other ranks."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()
        self.rank: int | None = None

    def set_rank(self, rank: int) -> None:
        self.rank = rank

    def _global_rank(self) -> int | None:
        if self.rank is None:  # before the engine said: torch.distributed knows, if it runs (never imported here)
            torch = sys.modules.get("torch")
            if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
                return torch.distributed.get_rank()
        return self.rank

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "rank0", False) and self._global_rank() not in (None, 0):
            return False
        if getattr(record, "once", False):
            key = record.getMessage()
            if key in self.said:
                return False
            self.said.add(key)
        return True


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed stream at interpreter exit: nothing to tell


_FORMATTER, _FILTER = _Formatter(), _Filter()
if not LOGGER.handlers:
    _handler = _Handler()
    _handler.setFormatter(_FORMATTER)
    LOGGER.addHandler(_handler)
    LOGGER.addFilter(_FILTER)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


def set_rank(rank: int) -> None:
    """This process's global rank (``rank0=True`` lines are said on rank 0 only)."""
    _FILTER.set_rank(rank)


def use_agent_prefix() -> None:
    """This process is a node agent: its lines carry the agent's prefix and pid."""
    _FORMATTER.as_agent(os.getpid())


def _extra(rank, once, rank0) -> dict:
    return {"rank": rank, "once": once, "rank0": rank0}


def info(message: str, rank: int | None = None, once: bool = False, rank0: bool = False) -> None:
    LOGGER.info(message, extra=_extra(rank, once, rank0))


def warning(message: str, rank: int | None = None, once: bool = False, rank0: bool = False) -> None:
    LOGGER.warning(message, extra=_extra(rank, once, rank0))

"""Runs of adjacent byte ranges: one read, write, send or checksum call per run instead of one per tensor.

A rank's slot holds tens of thousands of tensor entries, most of them next to each other; every
reader of a slot or rank file (checksums, ranged reads, replica transfers) walks them in
header order and joins neighbours first.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def runs(things: Iterable[T], adjacent: Callable[[T, T], bool]) -> list[list[T]]:
    """``things``, in their order, grouped wherever ``adjacent(previous, next)`` holds."""
    out: list[list[T]] = []
    for thing in things:
        if out and adjacent(out[-1][-1], thing):
            out[-1].append(thing)
        else:
            out.append([thing])
    return out


def byte_runs(entries) -> list[list]:
    """Tensor entries (header order) grouped where one ends where the next begins."""
    return runs(entries, lambda a, b: a.end == b.begin)


def spans(entries) -> list[tuple[int, int]]:
    """(offset, length) in the data section of each run of adjacent ``entries``."""
    return [(run[0].begin, run[-1].end - run[0].begin) for run in byte_runs(entries)]


__all__ = ["runs", "byte_runs", "spans"]

"""The one checksum of every checkpoint byte: CRC-32 (zlib's polynomial).

zlib-ng's implementation (carry-less multiply, about 20 GB/s on a current x86 core) when the
``zlib-ng`` package is installed, else Python's zlib (about 3 GB/s). Both compute the same CRC-32,
so a file checked with one is checked the same with the other; only the speed differs. Both
release the GIL on large buffers, so checking overlaps reading and writing in threads.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
    IMPLEMENTATION = "zlib-ng"
except ImportError:  # a source build without it: correct, only slower
    from zlib import crc32
    IMPLEMENTATION = "zlib"

__all__ = ["crc32", "IMPLEMENTATION"]

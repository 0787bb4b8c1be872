"""The command-line tools on checkpoint directories and node memory: `inspect`, `verify`, `export`.

May import: common, format, integrity, pec, store, memory, restore.
"""

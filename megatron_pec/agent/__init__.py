"""The node agent, one process per node and job, and the trainer's link to it: connections, the worker loop,
the writer thread, persists and commits, replication to and from peers.

May import: common, format, integrity, store, memory.
"""

"""The ground floor: the user-facing error, the package's one logger, fault-injection points, timing phases,
the few small collectives and coalesced copies. Everything else builds on it.

May import: nothing of megatron_pec.
"""

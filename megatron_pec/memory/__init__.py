"""Node memory: its files (home slots, the expert pool), the slot map, the regions a trainer may overwrite,
the budget, page-locking, and the agent's index of what node memory holds.

May import: common, format, integrity, pec.
"""

"""The only code that knows Megatron: the adapter, optimizer shards as slices, expert identity of parameters,
router token counts, the state beyond the slices, and a restore's copies back into Megatron's objects.

May import: common, format, integrity, pec.
"""

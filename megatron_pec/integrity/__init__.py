"""Checksums: sum64 (its C kernel, its Triton kernel and numpy fallbacks), CRC-32, summed copies, and which
kind a record holds.

May import: common, format.
"""

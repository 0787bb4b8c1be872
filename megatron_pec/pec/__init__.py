"""Partial Experts Checkpointing, pure: selection policies, lost-token (PLT) accounting, Dynamic-K, the PEC
state of expert versions and token counts. No torch.distributed, no files.

May import: common, format.
"""

"""Shipped test tooling: CPU stand-ins for CUDA, the one launcher, the scripted trainer, the simulated
cluster harness and the fault campaign. Never imported by production code.

May import: every layer (no layer imports it).
"""

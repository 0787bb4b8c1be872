"""The one compiled part of megatron-pec (everything else is in pyproject.toml): sum64 in one pass over the
bytes, copying them on the way where asked (``megatron_pec/integrity/sum64.py``). Optional: without a C compiler
the install goes on, and numpy's reductions sum instead."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("megatron_pec.integrity._fused_sum64", ["megatron_pec/integrity/_fused_sum64.c"],
                             extra_compile_args=["-O3"], optional=True)])

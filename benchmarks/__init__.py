"""Checkpointing benchmarks and the PLT-versus-quality experiment for megatron-pec.

* ``python -m benchmarks.checkpoint --quick|--full --json out.json`` - blocking time, bytes,
  persist throughput, restore time and training throughput of megatron-pec (K = all, 4, 2, 1),
  megatron-core ``torch_dist`` (sync and async), Megatron's legacy gather-to-DP-rank-0 path and
  DLRover Flash Checkpoint, next to the memcpy and write+fsync floors, all measured in one run
  on the real megatron-core GPT-MoE (2 gloo ranks on CPU); plus the experts-scaling curve.
* ``python -m benchmarks.quality`` - final validation loss and PLT under injected faults.

Results (JSON, markdown, PNG plots) go to ``benchmarks/results/``.
"""

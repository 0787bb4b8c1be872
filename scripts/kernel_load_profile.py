"""Where the checksum kernel's load spends its time in a fresh process (GPU; run by scripts/gpu_session.sh):
importing torch and Triton, then ``sum64_kernel.load``, with the load's 25 costliest calls."""
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
t0 = time.perf_counter()
import torch  # noqa: E402 (after the set-up above)

torch.cuda.init()
t1 = time.perf_counter()
from megatron_pec.integrity import sum64_kernel  # noqa: E402 (imports Triton)

t2 = time.perf_counter()
profile = cProfile.Profile()
profile.enable()
sum64_kernel.load(0)
profile.disable()
t3 = time.perf_counter()
print(f"import torch + CUDA init {t1 - t0:.3f} s, import Triton and the kernel {t2 - t1:.3f} s, load {t3 - t2:.3f} s")
pstats.Stats(profile).sort_stats("cumulative").print_stats(25)

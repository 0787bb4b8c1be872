"""The CPU stand-in layer refuses to replace a real GPU and changes no numerics."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, WORKERS

from megatron_pec.testing.launch import free_port

pytestmark = pytest.mark.both_releases


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_refuses_when_cuda_is_available():
    proc = run_python(
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from megatron_pec.testing import cpu\n"
        "try:\n"
        "    cpu.activate()\n"
        "except cpu.CudaAvailableError as e:\n"
        "    print('refused:', e)\n"
        "print('active:', cpu.is_active(), 'current_device patched:', torch.cuda.current_device.__module__)\n"
    )
    assert "refused: megatron_pec.testing.cpu refuses to activate: CUDA is available" in proc.stdout, proc.stderr
    assert "active: False" in proc.stdout
    assert "current_device patched: torch.cuda" in proc.stdout  # nothing was replaced


def test_same_numerics_with_and_without_standins():
    results = []
    for mode in ("without", "with"):
        proc = subprocess.run([sys.executable, str(WORKERS / "standin_numerics.py"), mode, str(free_port())],
                              capture_output=True, text=True, cwd=REPO, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]


def test_standins_only_redirect_placement_and_rng():
    proc = run_python(
        "import torch\n"
        "from megatron_pec.testing import cpu\n"
        "cpu.activate()\n"
        "x = torch.zeros(3, device='cuda'); y = torch.ones(2).cuda(); "
        "z = torch.ones(2).to(torch.cuda.current_device())\n"
        "assert x.device.type == y.device.type == z.device.type == 'cpu'\n"
        "assert torch.ones(2).type() == 'torch.cuda.FloatTensor'\n"
        "torch.cuda.manual_seed(7); a = torch.randn(4)\n"
        "torch.manual_seed(7); b = torch.randn(4)\n"
        "assert torch.equal(a, b)\n"
        "print('ok')\n"
    )
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]

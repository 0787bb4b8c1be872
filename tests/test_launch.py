"""The one launcher (``megatron_pec/testing/launch.py``): the torchrun command it builds, master ports it
reserves, the node agents it stops; and that nothing else in the repository builds a torchrun command."""

import os
import signal
import subprocess
import sys
import time

from conftest import REPO

from megatron_pec.testing import launch

TORCHRUN = "torch.distributed" + ".run"  # (spelled apart: the last test looks for this name in every file)


def test_the_command_of_a_script_a_module_and_a_node_of_a_multi_node_job():
    script = launch.command(launch.Launch("/x/train.py", ("--a", "1"), nproc=2), 29611)
    assert script == [sys.executable, "-m", TORCHRUN, "--nproc-per-node", "2", "--master-addr",
                      "127.0.0.1", "--master-port", "29611", "/x/train.py", "--a", "1"]
    module = launch.command(launch.Launch("benchmarks.worker", ("--out", "o"), module=True,
                                          options=("--rdzv-id", "r")), 29612)
    assert module[-8:] == ["--master-port", "29612", "--rdzv-id", "r", "-m", "benchmarks.worker", "--out", "o"]
    node = launch.command(launch.Launch("t.py", nnodes=2, node_rank=1, options=("--max-restarts", "0")), 29613)
    assert node[node.index("--nnodes") + 1] == "2" and node[node.index("--node-rank") + 1] == "1"


def test_a_port_handed_out_is_not_handed_out_again_at_once():
    first = launch.free_port(0)
    second = launch.free_port(0)  # (the same start: the first is reserved now)
    assert first != second and first in launch.PORTS and second in launch.PORTS


def fake_agent(node_dir, write_pidfile: bool = True) -> subprocess.Popen:
    """A process whose command line is a node agent's (``... megatron_pec agent --dir NODE``)."""
    os.makedirs(node_dir, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", "megatron_pec", "agent",
                             "--dir", str(node_dir)])
    if write_pidfile:
        (node_dir / "agent.pid").write_text(str(proc.pid))
    return proc


def test_agents_are_stopped_by_their_pid_files_and_their_command_lines(tmp_path):
    by_file = fake_agent(tmp_path / "job" / "node0")
    without_file = fake_agent(tmp_path / "job" / "node1", write_pidfile=False)
    elsewhere = fake_agent(tmp_path / "other" / "node0")
    try:
        assert launch.agent_pid(tmp_path / "job" / "node0") == by_file.pid
        assert launch.agents(tmp_path / "job") == sorted([by_file.pid, without_file.pid])
        assert launch.stop_agents(tmp_path / "job") == sorted([by_file.pid, without_file.pid])
        assert by_file.wait(10) == -signal.SIGKILL and without_file.wait(10) == -signal.SIGKILL
        assert elsewhere.poll() is None and launch.agent_pid(tmp_path / "job" / "node0") is None
    finally:
        for proc in (by_file, without_file, elsewhere):
            proc.kill()
            proc.wait()


def test_a_stale_pid_file_names_no_agent(tmp_path):
    node = tmp_path / "node0"
    node.mkdir()
    (node / "agent.pid").write_text(str(os.getpid()))  # a living process that is no agent
    assert launch.agent_pid(node) is None and launch.agents(tmp_path) == []


def test_the_grace_period_lets_an_agent_exit_by_itself(tmp_path):
    agent = fake_agent(tmp_path / "node0")
    started = time.monotonic()
    subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -TERM {agent.pid}"])
    launch.stop_agents(tmp_path, sig=signal.SIGKILL, grace_s=5.0)
    assert agent.wait(10) == -signal.SIGTERM and time.monotonic() - started < 5.0


def test_only_the_launcher_builds_a_torchrun_command():
    users = sorted(str(p.relative_to(REPO)) for folder in ("megatron_pec", "benchmarks", "tests", "examples")
                   for p in (REPO / folder).rglob("*.py") if TORCHRUN in p.read_text())
    assert users == ["megatron_pec/testing/launch.py"], users

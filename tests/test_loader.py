
"""The loader on its own (and the restore built from stand-in parts, without an engine or Megatron,
``workers/loader_alone.py``: one real gloo process, a checkpoint directory made by hand)."""

import subprocess
import sys

import pytest
from conftest import REPO, WORKERS, checkpoints

from megatron_pec.testing.launch import free_port

pytestmark = pytest.mark.megatron_free


def test_training_from_scratch_retires_node_markers_of_an_abandoned_run(tmp_path):
    """A restart that finds nothing committed trains from scratch and saves iteration 2 again: the dead
    run's node marker of 2 must be gone first, or the next commit of 2 would combine it (and its sizes and
    checksums) with the new run's files. The loader only decides; the restore retires, after deciding."""
    worker = [sys.executable, str(WORKERS / "loader_alone.py"), str(tmp_path / "ckpt"), str(free_port())]
    result = subprocess.run(worker, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no checkpoint found" in result.stdout and "stale marker retired" in result.stdout, result.stdout


def test_a_rank_with_nothing_to_restore_votes_with_as_many_values_as_one_that_planned(tmp_path):
    """The plan's MAX all-reduce must have the same size on every rank: a lost node whose replica was
    damaged has no iteration to plan while the survivor plans one from its memory (the fault campaign's
    replica_corrupt at iteration 2 aborted in gloo: 'Received data size doesn't match expected size')."""
    import argparse
    from types import SimpleNamespace

    from megatron_pec.config import PecConfig
    from megatron_pec.format.item_names import NON_EXPERT, ExpertId, item_name
    from megatron_pec.restore.loader import Candidates, LoadContext, Loader

    class Recording:
        def __init__(self):
            self.sizes = []

        def reduce(self, values, op):
            self.sizes.append(len(values))
            return list(values)

        def start_reduce(self, values, op):
            result = self.reduce(values, op)
            return SimpleNamespace(result=lambda: result)

    experts = tuple(ExpertId(1, e) for e in range(4))
    job = SimpleNamespace(rank=0, node_dir=str(tmp_path / "none"), fingerprint="f", topology={},
                          held_names={x: item_name(x) for x in experts[:2]}, all_experts=experts,
                          expert_layout=None, layout=None)
    config = PecConfig.from_args(argparse.Namespace(save=str(tmp_path), load=str(tmp_path), pec_job_id="j"))
    nothing, planned = Recording(), Recording()
    directory = checkpoints(tmp_path)
    Loader(LoadContext(job=job, config=config, collectives=nothing, slice_items={}), directory)._plan(
        None, Candidates([], {}, {}))
    Loader(LoadContext(job=job, config=config, collectives=planned, slice_items={}), directory)._vote(
        2, {NON_EXPERT: None, "L1.E0": None, "L1.E1": None}, "cannot", 2, planned={"L1.E0": 2, "L1.E1": 1})
    assert nothing.sizes == planned.sizes[:1], (nothing.sizes, planned.sizes)


def test_the_fault_harness_reads_the_restore_line_the_loader_logs(capsys):
    """The campaign and the fault tests judge every restore from this line: a suffix the harness does not
    know (the peer-memory lag) made it read no restore at all."""
    from megatron_pec.format.item_names import NON_EXPERT
    from megatron_pec.restore.loader import RestoreDecision
    from megatron_pec.testing.cluster import parse_restores

    def logged(source, newest):
        RestoreDecision(iteration=6, source=source, versions={NON_EXPERT: 6, "L1.E0": 6, "L1.E1": 4}, tensors={},
                      small={}, pec=None, tokens_at_target={}, report=None, newest=newest).log(rank=1)
        return parse_restores(capsys.readouterr().out)[1]

    from_peer = logged("peer memory (node 0)", newest=8)
    assert (from_peer.iteration, from_peer.source, from_peer.older, from_peer.behind) == (
        6, "peer memory (node 0)", {"L1.E1": 4}, 2)
    own = logged("memory", newest=8)
    assert (own.source, own.older, own.behind) == ("memory", {"L1.E1": 4}, 0)

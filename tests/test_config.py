"""The --pec-* flags: documented, validated with messages that name the flag."""

import argparse
from types import SimpleNamespace

import pytest

import megatron_pec
from megatron_pec.config import PecConfig, PecConfigError


def parser():
    return megatron_pec.add_pec_args(argparse.ArgumentParser(allow_abbrev=False))


def test_every_pec_flag_is_documented():
    actions = [a for a in parser()._actions if any(o.startswith("--pec-") for o in a.option_strings)]
    assert len(actions) >= 12
    for action in actions:
        assert action.help and len(action.help) > 20, action.option_strings


def test_defaults_mean_a_full_flash_checkpoint(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    config = PecConfig.from_args(parser().parse_args(["--pec-shm-dir", "/dev/shm/x"]))
    assert config.snapshot_k is None and config.persist_k is None and config.selection == "sequential"
    assert config.job_id == "default"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run42")
    assert PecConfig.from_args(SimpleNamespace(save="/s")).job_id == "run42"


def test_torchrun_static_rendezvous_never_names_the_job_none(monkeypatch, tmp_path):
    """Without --rdzv-id torchrun says 'none' for every job: two jobs sharing --pec-shm-dir must not
    share node directories, and a restart of one job must find its own again."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    a = PecConfig.from_args(SimpleNamespace(save=str(tmp_path / "a"), load=None)).job_id
    b = PecConfig.from_args(SimpleNamespace(save=str(tmp_path / "b"), load=None)).job_id
    assert a != b and "none" not in (a, b)
    assert PecConfig.from_args(SimpleNamespace(save=str(tmp_path / "a") + "/", load=None)).job_id == a
    assert PecConfig.from_args(SimpleNamespace(save=None, load=str(tmp_path / "a"))).job_id == a
    assert PecConfig.from_args(SimpleNamespace(save="/s", load=None, pec_job_id="mine")).job_id == "mine"


def test_the_environment_is_read_once_into_the_config():
    """torchrun's facts and the test hook come from the environment ``from_args`` is given."""
    env = {"TORCHELASTIC_RUN_ID": "run7", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "2", "MASTER_ADDR": "10.0.0.1",
           "MEGATRON_PEC_CHECK_ON_DEVICE": "1", "MEGATRON_PEC_FAILURE_DOMAIN": "rack-b",
           "MEGATRON_PEC_COPY_PROGRAMS": "4"}
    config = PecConfig.from_args(SimpleNamespace(save="/s"), env)
    assert (config.job_id, config.failure_domain, config.check_on_device) == ("run7", "rack-b", True)
    assert config.copy_programs == 4 and not config.copy_engine
    assert (config.launch.local_world_size, config.launch.node_rank, config.launch.agent_host) == (4, 2, "")
    plain = PecConfig.from_args(SimpleNamespace(save="/s"), {})
    assert (plain.launch.local_world_size, plain.launch.node_rank, plain.launch.agent_host) == (1, None, "127.0.0.1")
    assert not plain.check_on_device and plain.copy_programs is None
    assert PecConfig.from_args(parser().parse_args(["--pec-copy-engine"]), {}).copy_engine


@pytest.mark.parametrize("argv, flag", [
    (["--pec-snapshot-k", "0"], "--pec-snapshot-k"),
    (["--pec-snapshot-k", "1", "--pec-persist-k", "2"], "--pec-persist-k"),
    (["--pec-plt-threshold", "1.5"], "--pec-plt-threshold"),
    (["--pec-budget-mb", "-1"], "--pec-budget-mb"),
    (["--pec-keep", "-1"], "--pec-keep"),
    (["--pec-job-id", "a/b"], "--pec-job-id"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(PecConfigError, match=flag):
        PecConfig.from_args(parser().parse_args(argv))


def test_unknown_policy_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--pec-selection", "random"])
    assert "invalid choice" in capsys.readouterr().err


def test_docs_list_every_flag():
    from pathlib import Path

    from megatron_pec.config import flags_markdown

    docs = (Path(__file__).resolve().parents[1] / "docs" / "megatron-lm.md").read_text()
    assert flags_markdown() in docs, "docs/megatron-lm.md flags table is stale: regenerate it (see the comment)"


def test_a_checkpoint_error_exit_keeps_node_memory(monkeypatch):
    """CheckpointError exits through SystemExit, which skips sys.excepthook; the exit must still
    count as a crash, so the atexit hook leaves without a clean detach (that would delete memory)."""
    from megatron_pec import api
    from megatron_pec.common.errors import CheckpointError

    monkeypatch.setattr(api, "_crashed", False)
    with pytest.raises(CheckpointError, match="without an optimizer"):
        api.load_checkpoint([], None, None)
    assert api._crashed


def test_megatron_checkpoint_flags_megatron_pec_does_not_follow_are_named_once_with_the_reason(capsys):
    from megatron_pec.common import log
    from megatron_pec.config import megatron_flag_notes

    quiet = SimpleNamespace(no_save_optim=False, no_save_rng=False, async_save=False, ckpt_format="torch_dist",
                            non_persistent_ckpt_type="global", save_retain_interval=None)
    assert megatron_flag_notes(quiet) == [] and megatron_flag_notes(SimpleNamespace()) == []
    loud = SimpleNamespace(no_save_optim=True, no_save_rng=True, async_save=True, ckpt_format="torch",
                           non_persistent_ckpt_type="local", save_retain_interval=1000)
    notes = megatron_flag_notes(loud)
    for flag in ("--no-save-optim", "--no-save-rng", "--async-save", "--ckpt-format torch",
                 "--non-persistent-ckpt-type local", "--save-retain-interval 1000"):
        assert sum(flag in n for n in notes) == 1, flag
    assert all(": " in n for n in notes)  # the flag, then why
    for note in notes:  # as the engine says them, once, on rank 0
        log.warning(note, rank0=True)
    assert capsys.readouterr().err.splitlines() == [f"megatron-pec: WARNING {n}" for n in notes]

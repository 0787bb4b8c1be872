"""The pure parts of ``megatron/modelstate.py`` (no processes): Megatron's argument check with its
conditions and message, the rerun state machine's state through the JSON codec (its enums and call records
rebuilt by name, nothing else), --override-ckpt-iteration's side effects, the room for a pending rerun."""

from types import SimpleNamespace

import pytest
import torch

from megatron_pec.common.errors import CheckpointError
from megatron_pec.format import small_state
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.megatron import modelstate, restore


def megatron_args(**changes):
    args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, add_position_embedding=False,
                max_position_embeddings=4096, make_vocab_size_divisible_by=128, padded_vocab_size=50304,
                tokenizer_type="GPT2BPETokenizer", data_parallel_random_init=False, global_batch_size=8,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, vocab_file="vocab.json",
                phase_transition_iterations=None)
    return SimpleNamespace(**{**args, **changes})


def test_the_argument_check_compares_what_megatron_compares_with_its_message():
    saved = small_state.loads(small_state.dumps(modelstate.checkpoint_args(megatron_args())))
    modelstate.check_args(megatron_args(), saved)
    with pytest.raises(CheckpointError, match=r"num_attention_heads value from checkpoint \(4\) is not equal to "
                                              r"the input argument value \(8\)\."):
        modelstate.check_args(megatron_args(num_attention_heads=8), saved)
    with pytest.raises(CheckpointError, match="max_position_embeddings"):
        modelstate.check_args(megatron_args(max_position_embeddings=8192), saved)
    # compared only with --vocab-file, as Megatron does
    modelstate.check_args(megatron_args(max_position_embeddings=8192, vocab_file=None), saved)
    # the global batch size only with --phase-transition-iterations
    modelstate.check_args(megatron_args(global_batch_size=16), saved)
    with pytest.raises(CheckpointError, match="global_batch_size"):
        modelstate.check_args(megatron_args(global_batch_size=16, phase_transition_iterations="10"), saved)
    with pytest.raises(CheckpointError, match="pipeline_model_parallel_size"):
        modelstate.check_args(megatron_args(pipeline_model_parallel_size=2), saved)
    # a trainer without Megatron-LM's arguments compares those it has; an older checkpoint is not checked
    modelstate.check_args(SimpleNamespace(num_layers=2, hidden_size=64), saved)
    modelstate.check_args(megatron_args(num_layers=3), None)


def test_the_rerun_state_goes_through_json_with_its_types_rebuilt():
    from megatron.core import rerun_state_machine as rsm

    state = {"mode": rsm.RerunMode.VALIDATE_RESULTS, "state": rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT,
             "current_iteration": 7,
             "sharded": {"failed_validation_call": rsm.Call(rsm.Caller("loss is NaN", 3), 2),
                         "initial_result": torch.tensor(2.5), "max_values": {"loss": 1.0},
                         "data_iterator_checkpoints": [{"saved_microbatches": [{"tokens": torch.arange(4)}],
                                                        "replaying": False, "replay_pos": 0}]}}
    back = modelstate._enums_in(small_state.loads(small_state.dumps(modelstate._enums_out(state))), rsm)
    assert back["mode"] is rsm.RerunMode.VALIDATE_RESULTS
    assert back["state"] is rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
    call = back["sharded"]["failed_validation_call"]
    assert type(call) is rsm.Call and type(call.caller) is rsm.Caller
    assert call == state["sharded"]["failed_validation_call"]
    assert torch.equal(back["sharded"]["initial_result"], torch.tensor(2.5))
    saved = back["sharded"]["data_iterator_checkpoints"][0]["saved_microbatches"][0]["tokens"]
    assert torch.equal(saved, torch.arange(4))
    # only the machine's own types are rebuilt by name
    odd = {"__enum__": "Path", "name": "x"}
    assert modelstate._enums_in(odd, rsm) == odd
    # a pending rerun larger than its room is refused at its save, naming why
    with pytest.raises(CheckpointError, match="pending rerun saves"):
        modelstate.check_rerun_room(modelstate._enums_out(state), 64)
    modelstate.check_rerun_room(modelstate._enums_out(state), 1 << 20)


def test_override_ckpt_iteration_sets_the_samples_megatron_sets(monkeypatch):
    from megatron.core import num_microbatches_calculator

    monkeypatch.setattr(num_microbatches_calculator, "update_num_microbatches", lambda **_: None)
    args = SimpleNamespace(global_batch_size=8, consumed_train_samples=0, skipped_train_samples=0,
                           consumed_valid_samples=0)
    saved = SmallState(iteration=12, optimizer=None, scheduler=None, rng={}, num_floating_point_operations_so_far=0,
                       consumed_train_samples=96, skipped_train_samples=3, consumed_valid_samples=16,
                       args={"global_batch_size": 8})
    restore.restore_args(args, saved, finetune=False, override_iteration=5)
    assert (args.consumed_train_samples, args.skipped_train_samples, args.consumed_valid_samples) == (40, 0, 16)
    args.global_batch_size = 16
    with pytest.raises(CheckpointError, match=r"checkpoint global_batch_size \(8\) != current global_batch_size"):
        restore.restore_args(args, saved, finetune=False, override_iteration=5)


def test_a_trainer_of_its_own_never_imports_megatron_lms_training_package():
    """Megatron-core 0.19's wheel ships ``megatron.training``; importing it (the whole training
    package) took 0.57 s of a relaunched restore on an H200 in the example trainer. Its checkpoint version
    and its arguments are looked up only where Megatron-LM's loop has loaded them (a fresh process here)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("this megatron-core has no megatron.training to import (0.19's wheel has)")
    probe = ("import sys\n"
             "from megatron_pec.megatron import restore\n"
             "from megatron_pec.megatron.adapter import training_args\n"
             "restore.set_checkpoint_version(3.0)\n"
             "assert training_args() is None\n"
             "print(sorted(m for m in sys.modules if m.startswith('megatron.training')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_the_checkpoint_version_reaches_megatron_lm_where_its_loop_loaded_it(monkeypatch):
    import sys
    from types import ModuleType

    checkpointing = ModuleType("megatron.training.checkpointing")
    checkpointing.set_checkpoint_version = lambda v: setattr(checkpointing, "version", v)
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", checkpointing)
    restore.set_checkpoint_version(2.5)
    assert checkpointing.version == 2.5

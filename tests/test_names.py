"""Names that exist: every backquoted module path, ``module.Class``, ``Class.member``, class name and file path
in ``README.md``, ``docs/*.md`` and the package's docstrings names something that exists now.

Read from the source as text (no imports). What counts:
* a path with a ``/`` and a known ending, relative to the repository, the package or the ``docs`` folder;
* a dotted name whose first part is a module of ours (``budget.MemorySizing``, ``agent.link``): the module
  exists and defines the rest;
* a CapitalisedName, alone or before ``.member``: a class (or type alias) defined in our code, in
  megatron-core or in torch, or one of the outside names listed below; with ``.member``, a member of it.
Placeholders (``<...>``, ``*``, ``{...}``), flags, code and URLs are not names.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.megatron_free

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCE_ROOTS = [REPO / "megatron_pec", REPO / "benchmarks", REPO / "examples", REPO / "scripts", REPO / "tests"]
ENDINGS = (".py", ".md", ".sh", ".c", ".json", ".png", ".toml", ".patch", ".log", ".txt", ".yaml")
# Names of other projects the documents compare with or build on, not installed here (peers, DCP, NVRx, TE).
OUTSIDE = {"DdpCheckpointer", "LocalCheckpointManager", "StorageWriter", "StorageReader", "AsyncStager",
           "FileSystemWriter", "FaultyStorageWriter", "PersistentAsyncCaller", "TEGroupedMLP", "GroupedLinear",
           "TELayerNormColumnParallelLinear", "TENorm", "FusedLayerNorm", "MixedFusedLayerNorm",
           "GroupedMLP", "TopKRouter", "Terminate", "AsyncRequest", "AsyncSaveResponse", "MegatronModule"}
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")
CAPITAL = re.compile(r"^_?[A-Z][a-z0-9]+[A-Za-z0-9]*$")


def docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return [d for n in nodes if (d := ast.get_docstring(n))]


def texts() -> dict[str, str]:
    found = {str(p.relative_to(REPO)): p.read_text() for p in DOCUMENTS}
    for p in sorted((REPO / "megatron_pec").rglob("*.py")):
        found[str(p.relative_to(REPO))] = "\n".join(docstrings(p))
    return found


@lru_cache(maxsize=None)
def our_modules() -> dict[str, list[Path]]:
    """Every dotted suffix of our modules' names -> their files (``agent.link`` and ``link`` both name one)."""
    modules: dict[str, list[Path]] = {}
    for root in SOURCE_ROOTS:
        for p in root.rglob("*.py"):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            for i in range(len(parts)):
                modules.setdefault(".".join(parts[i:]), []).append(p)
    return modules


def defined(tree: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            names |= {t.attr for t in n.targets if isinstance(t, ast.Attribute)}
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
            t = n.target
            names.add(t.id if isinstance(t, ast.Name) else getattr(t, "attr", ""))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    all_ = next((n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), None)
    if isinstance(all_, (ast.List, ast.Tuple)):  # (a package's lazy names, served by its __getattr__)
        names |= {e.value for e in all_.elts if isinstance(e, ast.Constant)}
    return names


@lru_cache(maxsize=None)
def parsed(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


@lru_cache(maxsize=None)
def our_classes() -> dict[str, set[str]]:
    """Class name -> its members (methods, class attributes, attributes set on ``self``), over our code."""
    classes: dict[str, set[str]] = {}
    for root in SOURCE_ROOTS:
        for p in root.rglob("*.py"):
            for n in ast.walk(parsed(p)):
                if isinstance(n, ast.ClassDef):
                    classes.setdefault(n.name, set()).update(defined(n))
                elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    if n.targets[0].id[:1].isupper():  # a type alias or a constant
                        classes.setdefault(n.targets[0].id, set())
    return classes


@lru_cache(maxsize=None)
def library_classes() -> set[str]:
    """Class names megatron-core and the parts of torch we use define (read as text from the installed packages)."""
    site = Path(sysconfig.get_paths()["purelib"])
    names = set()
    for package in ("megatron", "torch/optim", "torch/cuda", "torch/distributed", "torch/nn", "torch/utils"):
        for p in (site / package).rglob("*.py"):
            names.update(re.findall(r"^\s*class (\w+)", p.read_text(errors="replace"), re.M))
    return names


BASES = [REPO, REPO / "megatron_pec", REPO / "docs", REPO / "benchmarks" / "results"]
TOP_FOLDERS = {p.name for b in BASES[:2] for p in b.iterdir() if p.is_dir() and not p.name.startswith(".")}
PACKAGE_FOLDERS = {p.name for p in (REPO / "megatron_pec").iterdir() if (p / "__init__.py").exists()}
OUTSIDE_ROOTS = set(sys.stdlib_module_names) | {"python", "torch", "megatron", "numpy", "triton", "self", "args",
                                                 "cls", "multistorageclient", "boto3", "dlrover"}
MEGATRON_FILES = {"pretrain_gpt.py", "training.py", "gpt_builders.py", "model_provider.py", "checkpointing.py",
                  "arguments.py"}  # (Megatron-LM's own files, which the documents name)
RUNTIME_ENDINGS = (".json", ".log", ".pid", ".sock", ".lock", ".txt", ".safetensors")


def path_problem(span: str) -> str | None:
    first = span.split("/")[0]
    if "/" in span and (first not in TOP_FOLDERS or span.startswith("megatron/training")):
        return None  # (a name at run time, a key, or a path in Megatron-LM's tree)
    if not span.endswith(ENDINGS + ("/",)) or span in MEGATRON_FILES:
        return None
    if "/" not in span:
        return None if any(True for r in SOURCE_ROOTS for _ in r.rglob(span)) else f"no file {span}"
    return None if any((b / span).exists() for b in BASES) else f"no file {span}"


def dotted_problem(parts: list[str]) -> str | None:
    if parts[0] in OUTSIDE_ROOTS or ".".join(parts) in our_modules():
        return None
    for cut in range(len(parts) - 1, 0, -1):
        prefix, rest = ".".join(parts[:cut]), parts[cut:]
        files = our_modules().get(prefix)
        if not files:
            continue
        if any(rest[0] in defined(parsed(f)) for f in files):
            members = our_classes().get(rest[0])
            if len(rest) == 1 or members is None or rest[1] in members:
                return None
            return f"{prefix}.{rest[0]} has no member {rest[1]}"
        if rest[0][:1].isupper() or prefix.split(".")[-1] in PACKAGE_FOLDERS or prefix.startswith("megatron_pec"):
            return f"module {prefix} defines no {rest[0]}"
        return None  # (an attribute of a variable named like a module)
    if CAPITAL.match(parts[0]):
        members = our_classes().get(parts[0])
        if members is None:
            return None if parts[0] in library_classes() | OUTSIDE else f"no class {parts[0]}"
        return None if parts[1] in members else f"class {parts[0]} has no member {parts[1]}"
    if parts[0] in PACKAGE_FOLDERS | {"megatron_pec"} or parts[1][:1].isupper():
        return f"no module {'.'.join(parts[:-1])}"
    return None


def problem(span: str) -> str | None:
    """Why ``span`` names nothing that exists, or None (it exists, or it is no name)."""
    span = span.strip().removesuffix("()")
    if any(c in span for c in "<>*{}()$ =,:;'\"[]|!?@#%&+") or span.startswith(("-", "/", "..", "~", "http")):
        return None
    if "/" in span or span.endswith(".py"):
        return path_problem(span)
    if span.endswith(RUNTIME_ENDINGS):
        return None
    if DOTTED.match(span):
        return dotted_problem(span.split("."))
    if CAPITAL.match(span) and any(c.isupper() for c in span[1:]):
        known = set(our_classes()) | library_classes() | OUTSIDE | set(dir(builtins))
        return None if span in known else f"no class {span}"
    return None


def stale_names(found: dict[str, str]) -> list[str]:
    return [f"{where}: `{span}`: {why}" for where, text in found.items() for span in SPAN.findall(text)
            if (why := problem(span))]


def test_every_name_in_the_documents_and_docstrings_exists():
    assert stale_names(texts()) == []


def test_the_name_check_sees_a_planted_stale_name():
    planted = {"docs/planted.md": "The agent's CPU ledger is `agent.cpu.CpuLedger`, its replicas "
               "`replicas.ReplicaStore`, laid out in `agent/memory.py` by `MemoryLayout`; `Agent._storage` holds "
               "the storage.",
               "megatron_pec/planted.py": "Read by ``restore/staging.py`` (`PecBook.no_such_method`)."}
    found = stale_names(planted)
    assert len(found) == 6, found
    assert stale_names({"docs/ok.md": "`agent.cpu_ledger.CpuLedger`, `memory/slot_map.py`, `SlotMap`, "
                        "`PecBook.plan`, `budget.MemorySizing`, `GPTModel`"}) == []

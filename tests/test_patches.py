"""The Megatron-LM patch set (patches/*.patch, patches/apply.sh) against a real checkout.

Set MEGATRON_LM_DIR to a pristine Megatron-LM checkout at tag core_v0.16.1 (a git
checkout, or an exported tree). Every test works on its own copy in a temp dir;
the checkout itself is never modified.
"""

from __future__ import annotations

import ast
import difflib
import os
import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "patches" / "apply.sh"
TAG_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
TRAINING = "megatron/training/training.py"
PRETRAIN = "pretrain_gpt.py"

# The only lines the patches may remove and add (blank lines aside).
TRAINING_REMOVED = [
    "from megatron.training.checkpointing import load_checkpoint",
    "from megatron.training.checkpointing import save_checkpoint, save_grads",
]
TRAINING_ADDED = [
    "from megatron_pec import load_checkpoint",
    "from megatron_pec import save_checkpoint",
    "from megatron.training.checkpointing import save_grads",
]
PRETRAIN_REMOVED = ["        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"]
PRETRAIN_ADDED = [
    "from megatron_pec import add_pec_args",
    "def add_extra_args(parser):",
    '    """Add the --pec-* flags of megatron-pec, plus the ModelOpt flags when ModelOpt is installed."""',
    "    if has_nvidia_modelopt:",
    "        parser = add_modelopt_args(parser)",
    "    return add_pec_args(parser)",
    "        extra_args_provider=add_extra_args,",
]


@pytest.fixture(scope="module")
def source() -> Path:
    value = os.environ.get("MEGATRON_LM_DIR")
    if not value:
        pytest.skip("MEGATRON_LM_DIR not set: point it to a Megatron-LM checkout at tag core_v0.16.1")
    src = Path(value).resolve()
    if not (src / TRAINING).is_file() or not (src / PRETRAIN).is_file():
        pytest.fail(f"MEGATRON_LM_DIR={src} is not a Megatron-LM tree (no {TRAINING} / {PRETRAIN})")
    if "megatron_pec" in (src / TRAINING).read_text() + (src / PRETRAIN).read_text():
        pytest.skip(f"MEGATRON_LM_DIR={src} is already patched: point it to a pristine core_v0.16.1 checkout")
    if shutil.which("git") is None:
        pytest.skip("git not found: apply.sh needs it")
    return src


def git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent))
    cmd = ["git", "-C", str(cwd), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def plain_copy(src: Path, dst: Path) -> Path:
    """An exported tree: the checkout without its .git."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    return dst


def git_copy(src: Path, dst: Path) -> Path:
    """A git checkout at the tag commit, sharing the source's objects (cheap)."""
    if not (src / ".git").exists():
        pytest.skip(f"MEGATRON_LM_DIR={src} is not a git checkout: the git-checkout path is not tested")
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(src), str(dst)], check=True)
    git(dst, "-c", "advice.detachedHead=false", "checkout", "-q", TAG_COMMIT)
    return dst


def apply(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(APPLY), str(tree)], capture_output=True, text=True)


def changed_lines(old: str, new: str) -> tuple[list[str], list[str]]:
    """(removed, added) lines of a line diff, blank lines left out."""
    removed, added = [], []
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0):
        if line.startswith(("---", "+++", "@@")):
            continue
        if line[1:].strip():
            (removed if line[0] == "-" else added).append(line[1:])
    return removed, added


def imported_from(path: Path) -> dict[str, str]:
    """Module-level `from X import name` bindings: name -> X."""
    tree = ast.parse(path.read_text(), str(path))
    return {a.asname or a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}


def check_patched(src: Path, tree: Path, tmp_path: Path) -> None:
    for rel in (TRAINING, PRETRAIN):
        py_compile.compile(str(tree / rel), cfile=str(tmp_path / (Path(rel).name + "c")), doraise=True)

    removed, added = changed_lines((src / TRAINING).read_text(), (tree / TRAINING).read_text())
    assert (removed, added) == (TRAINING_REMOVED, TRAINING_ADDED)
    removed, added = changed_lines((src / PRETRAIN).read_text(), (tree / PRETRAIN).read_text())
    assert (removed, added) == (PRETRAIN_REMOVED, PRETRAIN_ADDED)

    names = imported_from(tree / TRAINING)
    assert names["load_checkpoint"] == "megatron_pec"
    assert names["save_checkpoint"] == "megatron_pec"
    assert names["save_grads"] == "megatron.training.checkpointing"
    assert imported_from(tree / PRETRAIN)["add_pec_args"] == "megatron_pec"


def run_provider(tree: Path, has_modelopt: bool) -> list[str]:
    """Run the patched add_extra_args with stand-ins; returns the providers called, in order."""
    module = ast.parse((tree / PRETRAIN).read_text())
    func = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "add_extra_args")
    calls: list[str] = []
    ns = {
        "has_nvidia_modelopt": has_modelopt,
        "add_modelopt_args": lambda p: calls.append("modelopt") or p,
        "add_pec_args": lambda p: calls.append("pec") or p,
    }
    exec(compile(ast.Module(body=[func], type_ignores=[]), PRETRAIN, "exec"), ns)
    parser = object()
    assert ns["add_extra_args"](parser) is parser
    return calls


def test_apply_to_plain_tree(source, tmp_path):
    tree = plain_copy(source, tmp_path / "mlm")
    result = apply(tree)
    assert result.returncode == 0, result.stderr
    assert "not a git checkout" in result.stdout and "applied 0002" in result.stdout
    check_patched(source, tree, tmp_path)
    assert run_provider(tree, has_modelopt=False) == ["pec"]
    assert run_provider(tree, has_modelopt=True) == ["modelopt", "pec"]


def test_apply_to_git_checkout_then_refuse_second_apply(source, tmp_path):
    tree = git_copy(source, tmp_path / "mlm")
    result = apply(tree)
    assert result.returncode == 0, result.stderr
    assert TAG_COMMIT in result.stdout
    check_patched(source, tree, tmp_path)
    assert git(tree, "diff", "--cached", "--name-only") == ""  # working tree only, nothing staged

    before = {rel: (tree / rel).read_text() for rel in (TRAINING, PRETRAIN)}
    again = apply(tree)
    assert again.returncode != 0
    assert "already patched" in again.stderr
    assert "Traceback" not in again.stderr
    assert {rel: (tree / rel).read_text() for rel in (TRAINING, PRETRAIN)} == before


def test_second_apply_refuses_on_plain_tree(source, tmp_path):
    tree = plain_copy(source, tmp_path / "mlm")
    assert apply(tree).returncode == 0
    again = apply(tree)
    assert again.returncode != 0 and "already patched" in again.stderr


def test_refuses_other_version_marker(source, tmp_path):
    tree = plain_copy(source, tmp_path / "mlm")
    marker = tree / "megatron/core/package_info.py"
    marker.write_text(marker.read_text().replace("PATCH = 1", "PATCH = 0", 1))
    result = apply(tree)
    assert result.returncode != 0
    assert "0.16.0" in result.stderr and "0.16.1" in result.stderr
    assert (tree / TRAINING).read_text() == (source / TRAINING).read_text()


def test_refuses_other_commit(source, tmp_path):
    tree = git_copy(source, tmp_path / "mlm")
    marker = tree / "megatron/core/package_info.py"
    marker.write_text(marker.read_text().replace("PATCH = 1", "PATCH = 2", 1))
    git(tree, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qam", "bump")
    git(tree, "tag", "core_v0.16.2")
    result = apply(tree)
    assert result.returncode != 0
    assert "core_v0.16.2" in result.stderr and "not core_v0.16.1" in result.stderr
    assert (tree / TRAINING).read_text() == (source / TRAINING).read_text()


def test_refuses_edited_file_and_changes_nothing(source, tmp_path):
    tree = plain_copy(source, tmp_path / "mlm")
    with open(tree / PRETRAIN, "a") as f:
        f.write("# local edit\n")
    result = apply(tree)
    assert result.returncode != 0 and "differs from its core_v0.16.1 version" in result.stderr
    assert (tree / TRAINING).read_text() == (source / TRAINING).read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="git not found: apply.sh needs it")
def test_refuses_a_directory_that_is_not_megatron(tmp_path):
    result = apply(tmp_path)
    assert result.returncode != 0 and "not a Megatron-LM tree" in result.stderr

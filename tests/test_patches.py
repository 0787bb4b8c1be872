"""The Megatron-LM patch set (patches/<tag>/*.patch, patches/apply.sh) against real release trees.

Every supported release is tested from the archives in ``../shared/megatron-lm/`` (or
``$MEGATRON_LM_ARCHIVES``), unpacked once and copied per test. ``MEGATRON_LM_DIR`` may point to a
git clone of Megatron-LM (a checkout or a bare mirror): the git-checkout path is then tested on
clones of it at each release's commit (it is never modified).
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

from megatron_pec.testing import megatron_lm

REPO = Path(__file__).resolve().parents[1]
APPLY = REPO / "patches" / "apply.sh"
TAG_COMMITS = {"core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
               "core_v0.17.1": "266f1c97dca477ca8b92c16087506da2000b0b84",
               "core_v0.18.2": "571370c829ca768fe37244f4e2e7f28d8accc4ab",
               "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3"}
TRAINING = "megatron/training/training.py"
PRETRAIN = "pretrain_gpt.py"

# The only lines the patches may remove and add (blank lines aside): two import styles.
TRAINING_CHANGES = {
    "lines": ([
        "from megatron.training.checkpointing import load_checkpoint",
        "from megatron.training.checkpointing import save_checkpoint, save_grads",
    ], [
        "from megatron_pec import load_checkpoint",
        "from megatron_pec import save_checkpoint",
        "from megatron.training.checkpointing import save_grads",
    ]),
    "block": ([
        "    load_checkpoint,",
        "    save_checkpoint,",
    ], [
        "from megatron_pec import load_checkpoint",
        "from megatron_pec import save_checkpoint",
    ]),
}
IMPORT_STYLE = {"core_v0.16.1": "lines", "core_v0.17.1": "lines", "core_v0.18.2": "block", "core_v0.19.0": "block"}
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
no_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not found: apply.sh needs it")


def release(tag: str) -> Path:
    tree = megatron_lm.pristine_tree(tag)
    if tree is None:
        pytest.skip(f"no archive Megatron-LM-{tag}.tar.gz in {[str(d) for d in megatron_lm.archive_dirs()]}")
    return tree


@pytest.fixture(scope="module")
def git_source() -> Path:
    value = os.environ.get("MEGATRON_LM_DIR")
    if not value:
        pytest.skip("MEGATRON_LM_DIR not set: the git-checkout path needs a Megatron-LM git clone")
    src = Path(value).resolve()
    probe = subprocess.run(["git", "-C", str(src), "rev-parse", "--git-dir"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"MEGATRON_LM_DIR={src} is not a git repository (a checkout or a bare clone)")
    return src


def git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent))
    cmd = ["git", "-C", str(cwd), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def plain_copy(src: Path, dst: Path) -> Path:
    """An exported tree: the checkout without its .git."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    return dst


def git_copy(src: Path, dst: Path, commit: str) -> Path:
    """A git checkout at ``commit``, sharing the source's objects (cheap)."""
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(src), str(dst)], check=True)
    try:
        git(dst, "-c", "advice.detachedHead=false", "checkout", "-q", commit)
    except subprocess.CalledProcessError:
        pytest.skip(f"MEGATRON_LM_DIR has no commit {commit}")
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


def check_patched(tag: str, src: Path, tree: Path, tmp_path: Path) -> None:
    for rel in (TRAINING, PRETRAIN):
        py_compile.compile(str(tree / rel), cfile=str(tmp_path / (Path(rel).name + "c")), doraise=True)

    removed, added = changed_lines((src / TRAINING).read_text(), (tree / TRAINING).read_text())
    assert (removed, added) == TRAINING_CHANGES[IMPORT_STYLE[tag]]
    removed, added = changed_lines((src / PRETRAIN).read_text(), (tree / PRETRAIN).read_text())
    assert (removed, added) == (PRETRAIN_REMOVED, PRETRAIN_ADDED)

    names = imported_from(tree / TRAINING)
    assert names["load_checkpoint"] == "megatron_pec"
    assert names["save_checkpoint"] == "megatron_pec"
    assert names["save_grads"] == "megatron.training.checkpointing"
    assert imported_from(tree / PRETRAIN)["add_pec_args"] == "megatron_pec"
    assert provider_passed(tree) == "add_extra_args"


def provider_passed(tree: Path) -> str:
    """The name passed as ``extra_args_provider=`` in pretrain_gpt.py's ``__main__`` block (to pretrain()
    up to core_v0.17.1, to parse_and_validate_args() from core_v0.18.2)."""
    module = ast.parse((tree / PRETRAIN).read_text())
    main = next(n for n in module.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    found = [k.value for n in ast.walk(main) if isinstance(n, ast.Call) for k in n.keywords
             if k.arg == "extra_args_provider"]
    assert len(found) == 1
    return ast.unparse(found[0])


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


@no_git
@pytest.mark.parametrize("tag", megatron_lm.RELEASES)
def test_apply_to_each_release_then_refuse_second_apply(tag, tmp_path):
    source = release(tag)
    tree = plain_copy(source, tmp_path / "mlm")
    result = apply(tree)
    assert result.returncode == 0, result.stderr
    assert f"match {tag}" in result.stdout and f"applied {tag}/0002" in result.stdout
    check_patched(tag, source, tree, tmp_path)
    assert run_provider(tree, has_modelopt=False) == ["pec"]
    assert run_provider(tree, has_modelopt=True) == ["modelopt", "pec"]

    before = {rel: (tree / rel).read_text() for rel in (TRAINING, PRETRAIN)}
    again = apply(tree)
    assert again.returncode != 0
    assert f"already patched for megatron-pec ({tag}" in again.stderr and "Traceback" not in again.stderr
    assert {rel: (tree / rel).read_text() for rel in (TRAINING, PRETRAIN)} == before


@no_git
def test_refuses_an_unsupported_version(tmp_path):
    tree = plain_copy(release(megatron_lm.OLDEST), tmp_path / "mlm")
    marker = tree / "megatron/core/package_info.py"
    marker.write_text(marker.read_text().replace("MINOR = 16", "MINOR = 15", 1))
    with open(tree / TRAINING, "a") as f:  # an older release differs in its files too
        f.write("# older\n")
    result = apply(tree)
    assert result.returncode != 0
    assert "0.15.1" in result.stderr and "core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0" in result.stderr
    assert "Traceback" not in result.stderr


@no_git
def test_refuses_an_edited_file_and_changes_nothing(tmp_path):
    source = release(megatron_lm.NEWEST)
    tree = plain_copy(source, tmp_path / "mlm")
    with open(tree / PRETRAIN, "a") as f:
        f.write("# local edit\n")
    result = apply(tree)
    assert result.returncode != 0 and "differs from core_v0.19.0" in result.stderr
    assert (tree / TRAINING).read_text() == (source / TRAINING).read_text()


@no_git
def test_refuses_a_git_checkout_at_another_commit(tmp_path):
    source = release(megatron_lm.NEWEST)
    tree = plain_copy(source, tmp_path / "mlm")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "fork")
    git(tree, "tag", "my-fork")
    result = apply(tree)
    assert result.returncode != 0
    assert "my-fork" in result.stderr and "not a supported release" in result.stderr
    assert (tree / TRAINING).read_text() == (source / TRAINING).read_text()


@no_git
@pytest.mark.parametrize("tag", sorted(TAG_COMMITS))
def test_apply_to_git_checkout(git_source, tag, tmp_path):
    tree = git_copy(git_source, tmp_path / "mlm", TAG_COMMITS[tag])
    pristine = {rel: (tree / rel).read_text() for rel in (TRAINING, PRETRAIN)}
    result = apply(tree)
    assert result.returncode == 0, result.stderr
    assert TAG_COMMITS[tag] in result.stdout
    assert git(tree, "diff", "--cached", "--name-only") == ""  # working tree only, nothing staged
    removed, added = changed_lines(pristine[TRAINING], (tree / TRAINING).read_text())
    assert (removed, added) == TRAINING_CHANGES[IMPORT_STYLE[tag]]


@no_git
def test_refuses_a_directory_that_is_not_megatron(tmp_path):
    result = apply(tmp_path)
    assert result.returncode != 0 and "not a Megatron-LM tree" in result.stderr

"""The package's boundaries, checked on its source: one owner per concern.

* Megatron is imported only by the adapter (``megatron_pec/megatron/``) and the CPU test stand-ins
  (``megatron_pec/testing/``);
* production code never imports ``megatron_pec.testing``;
* no module assigns attributes of another module's objects - apart from the few places whose job
  it is, listed here with the reason;
* the node agent starts without torch or Megatron.
"""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "megatron_pec"
SOURCES = sorted(PACKAGE.rglob("*.py"))

# file -> attribute targets it may assign on objects that are not its own (``self``/``cls``), and why.
ALLOWED_FOREIGN_WRITES = {
    "api.py": {"sys.excepthook", "excepthook.megatron_pec"},      # records crashes so exit keeps node memory
    "log.py": {"LOGGER.propagate"},                                # the package's lines go to its own handler only
    "megatron/restore.py": {"scheduler.num_steps", "args.consumed_train_samples", "args.skipped_train_samples",
                            "args.consumed_valid_samples", "args.finetune"},  # Megatron's load_checkpoint side effects
    "megatron/optstate.py": {"inner.param_groups", "inner.state"},  # shown one param per group, then put back
    "testing/cpu.py": None,                                          # the CPU stand-ins patch torch/megatron
    "testing/megatron_lm_cpu.py": None,                              # ... and Megatron-LM's training loop
}


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def foreign_attribute_writes(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    base = sub.value
                    while isinstance(base, (ast.Attribute, ast.Subscript)):
                        base = base.value
                    if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                        found.add(ast.unparse(sub))
    return found


def test_megatron_is_imported_only_by_the_adapter_and_the_test_stand_ins():
    leaks = {relative(p): sorted(n for n in imports(p) if n == "megatron" or n.startswith("megatron."))
             for p in SOURCES if not relative(p).startswith(("megatron/", "testing/"))}
    assert not {f: n for f, n in leaks.items() if n}, leaks


def test_production_code_never_imports_the_testing_package():
    users = {relative(p) for p in SOURCES if not relative(p).startswith("testing/")
             and any(n.startswith("megatron_pec.testing") for n in imports(p))}
    assert not users, users


def test_no_module_assigns_attributes_of_another_modules_objects():
    unexpected = {}
    for path in SOURCES:
        writes = foreign_attribute_writes(path)
        allowed = ALLOWED_FOREIGN_WRITES.get(relative(path), set())
        extra = set() if allowed is None else writes - allowed
        if extra:
            unexpected[relative(path)] = sorted(extra)
    assert not unexpected, unexpected


def test_the_scanner_sees_foreign_writes(tmp_path):
    """The check above can fail: it reports exactly the writes on other objects."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(engine, self):\n    engine.live = 1\n    self.x = 2\n    engine.pec.k += 1\n"
                      "    a.b[0].c = 3\n")
    assert foreign_attribute_writes(sample) == {"engine.live", "engine.pec.k", "a.b[0].c"}


def test_the_agent_starts_without_torch_or_megatron():
    code = ("import sys, megatron_pec.agent.server, megatron_pec.__main__; "
            "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]", result.stdout

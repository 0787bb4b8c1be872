
"""The package's boundaries, checked on its source: one owner per concern.

* the package is cut in folders by concern, each a layer that imports only the layers below it
  (``LAYERS``); the package root holds the entry points, the composition and the configuration;
* Megatron is imported only by the adapter (``megatron_pec/megatron/``) and the CPU test stand-ins
  (``megatron_pec/testing/``);
* production code never imports ``megatron_pec.testing``;
* no module assigns attributes of another module's objects - apart from the few places whose job
  it is, listed here with the reason;
* the process environment is read in ``config.py`` only, apart from the test hooks listed here;
* the modules import each other without a cycle, imports inside functions counted (they hide a cycle
  from the interpreter until the function runs, not from the reader);
* the node agent starts without torch or Megatron.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.megatron_free

PACKAGE = REPO / "megatron_pec"
SOURCES = sorted(PACKAGE.rglob("*.py"))

# Folder -> the folders its modules may import (besides their own), bottom to top. The package root is
# two layers: the configuration (``config``, ``job_facts``), and the entry points with the composition
# (``api``, ``__main__``, ``engine``, ``__init__``), which may import every layer. ``testing/`` (shipped test
# tooling) may import anything; no layer imports it.
LAYERS = {
    "common": set(),                                                   # errors, log, faults, phases, collectives
    "format": {"common"},                                              # records, file and wire encodings
    "integrity": {"common", "format"},                                 # checksums, their kernels and fallbacks
    "pec": {"common", "format"},                                       # selection policies, lost tokens, PEC state
    "store": {"common", "format", "integrity"},                        # the storage seam, the checkpoint directory
    "memory": {"common", "format", "integrity", "pec"},                # node-memory files, layout, regions, budget
    "configuration": {"common", "format", "integrity", "pec", "memory"},
    "megatron": {"common", "format", "integrity", "pec"},              # the only code that knows Megatron
    "agent": {"common", "format", "integrity", "store", "memory"},     # the node agent process
    "save": {"common", "format", "integrity", "pec", "store", "memory", "configuration", "agent"},
    "restore": {"common", "format", "integrity", "pec", "store", "memory", "configuration", "agent"},
    "tools": {"common", "format", "integrity", "pec", "store", "memory", "restore"},  # export, inspect, verify
}
CONFIGURATION = {"config.py", "job_facts.py"}
ENTRY = {"__init__.py", "__main__.py", "api.py", "engine.py"}


# file -> attribute targets it may assign on objects that are not its own (``self``/``cls``), and why.
ALLOWED_FOREIGN_WRITES = {
    "api.py": {"sys.excepthook", "excepthook.megatron_pec"},      # records crashes so exit keeps node memory
    "common/log.py": {"LOGGER.propagate"},                         # the package's lines go to its own handler only
    "megatron/restore.py": {"scheduler.num_steps", "args.consumed_train_samples", "args.skipped_train_samples",
                            "args.consumed_valid_samples", "args.finetune"},  # Megatron's load_checkpoint side effects
    "megatron/optstate.py": {"inner.param_groups", "inner.state"},  # shown one param per group, then put back
    "testing/cpu.py": None,                                          # the CPU stand-ins patch torch/megatron
    "testing/megatron_lm_cpu.py": None,                              # ... and Megatron-LM's training loop
    "testing/state_dump.py": None,                                   # the parity tests' hooks in a training script
}


# file -> why it reads the process environment (``config.PecConfig.from_args`` reads everything else)
ALLOWED_ENVIRONMENT_READERS = {
    "config.py": "the one configuration: the launcher's facts, the failure domain, two test hooks",
    "common/faults.py": "fault injection, a test hook by design (MEGATRON_PEC_FAULT and its companions)",
    "memory/slots.py": "a test hook: MEGATRON_PEC_CGROUP_DIR points the tmpfs budget check at other files",
    "agent/client.py": "hands the trainer's environment on to the agent process it starts",
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


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path, modules: set[str], root: Path = REPO) -> set[str]:
    """The package's modules that ``path`` imports, wherever the import statement stands (module level,
    inside a function or a class): ``from megatron_pec.common import log`` imports the module
    ``megatron_pec.common.log``, ``from megatron_pec.common.log import info`` the module ``megatron_pec.common.log``;
    relative imports resolved."""
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != here)
    return found


def import_cycles(sources: list[Path], root: Path = REPO) -> list[list[str]]:
    """Every strongly connected group of more than one module in the import graph of ``sources``
    (Tarjan's algorithm), each sorted; empty when the graph has no cycle."""
    modules = {module_name(p, root) for p in sources}
    graph = {module_name(p, root): sorted(package_imports(p, modules, root)) for p in sources}
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


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


def layer_of(rel: str) -> str:
    """The layer of a module, by its path relative to the package."""
    if "/" in rel:
        return rel.split("/")[0]
    return "configuration" if rel in CONFIGURATION else "entry" if rel in ENTRY else f"unplaced {rel}"


def layer_violations(sources: list[Path], package: Path) -> dict[str, list[str]]:
    """Module -> the modules it imports against ``LAYERS``."""
    root = package.parent
    modules = {module_name(p, root) for p in sources}
    by_name = {module_name(p, root): p.relative_to(package).as_posix() for p in sources}
    found = {}
    for path in sources:
        rel = path.relative_to(package).as_posix()
        here = layer_of(rel)
        if here in ("entry", "testing"):
            continue
        allowed = LAYERS.get(here, set()) | {here}
        bad = sorted(by_name[m] for m in package_imports(path, modules, root) if layer_of(by_name[m]) not in allowed)
        if bad or here not in LAYERS:
            found[rel] = bad or [f"{here}: no layer of LAYERS holds it"]
    return found


def test_the_package_root_holds_only_entry_points_composition_and_configuration():
    at_root = {p.name for p in PACKAGE.glob("*.py")}
    assert at_root <= ENTRY | CONFIGURATION, at_root - ENTRY - CONFIGURATION
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {"configuration"} | {"testing"}, folders


def test_each_layer_imports_only_the_layers_below_it():
    assert not layer_violations(SOURCES, PACKAGE), layer_violations(SOURCES, PACKAGE)


def stated_imports(init: Path) -> set[str] | None:
    """The layers a subpackage's ``__init__.py`` docstring says it may import (its ``May import:`` line), or
    None where it states no role or no such line."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    line = next((x for x in doc.splitlines() if x.startswith("May import:")), None)
    if line is None or len(doc.split("May import:")[0].strip()) < 40:
        return None
    stated = line.removeprefix("May import:").strip().rstrip(".")
    return set() if stated == "nothing of megatron_pec" else {w.strip() for w in stated.split(",")}


def test_each_folder_states_its_role_and_what_it_may_import_as_the_layers_do():
    for name, allowed in LAYERS.items():
        if name != "configuration":
            assert stated_imports(PACKAGE / name / "__init__.py") == allowed, f"{name}/__init__.py against LAYERS"
    testing = ast.get_docstring(ast.parse((PACKAGE / "testing" / "__init__.py").read_text()))
    assert "May import: every layer" in testing and "Never imported by production code" in testing


def test_the_folder_check_sees_a_docstring_that_differs_from_the_layers(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('"""Checksums of every kind, computed where the bytes are.\n\nMay import: common, store.\n"""\n')
    assert stated_imports(init) == {"common", "store"} != LAYERS["integrity"]
    init.write_text('"""May import: common, format."""\n')  # (no role stated)
    assert stated_imports(init) is None


def test_the_layer_check_sees_an_import_against_the_layers(tmp_path):
    """The check above can fail: a made-up module of the checksum layer that imports the agent is found,
    and so is a module in a folder no layer names."""
    package = tmp_path / "megatron_pec"
    for folder in ("integrity", "agent", "format", "scratch"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "format" / "records.py").write_text("X = 1\n")
    (package / "agent" / "server.py").write_text("from megatron_pec.format.records import X\n")
    (package / "integrity" / "sums.py").write_text("from megatron_pec.format import records\n\n"
                                                  "def f():\n    from megatron_pec.agent.server import X\n")
    sources = sorted(package.rglob("*.py"))
    assert layer_violations(sources, package) == {"integrity/sums.py": ["agent/server.py"],
                                                  "scratch/__init__.py": ["scratch: no layer of LAYERS holds it"]}


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


def reads_environment(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv", "environb") for a in node.names):
            return True
    return False


def test_the_environment_is_read_in_one_place():
    readers = {relative(p) for p in SOURCES if not relative(p).startswith("testing/") and reads_environment(p)}
    assert readers <= ALLOWED_ENVIRONMENT_READERS.keys(), readers - ALLOWED_ENVIRONMENT_READERS.keys()


def test_the_modules_import_each_other_without_a_cycle():
    assert not import_cycles(SOURCES), import_cycles(SOURCES)


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    """The check above can fail: a cycle closed by an import inside a function is found."""
    package = tmp_path / "megatron_pec"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from megatron_pec.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from megatron_pec import a\n    return a\n")
    (package / "c.py").write_text("from . import a\n")
    sources = sorted(package.rglob("*.py"))
    names = {module_name(p, tmp_path) for p in sources}
    assert names == {"megatron_pec", "megatron_pec.a", "megatron_pec.b", "megatron_pec.c"}
    assert import_cycles(sources, tmp_path) == [["megatron_pec.a", "megatron_pec.b"]]


def test_the_agent_starts_without_torch_or_megatron():
    code = ("import sys, megatron_pec.agent.server, megatron_pec.__main__; "
            "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]", result.stdout


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 60  # (a function fits a screen; a class, a sitting)


def definition_sizes(roots, base=REPO) -> tuple[dict[str, int], dict[str, int]]:
    """(class -> lines, function -> lines) of every definition under ``roots`` (``path:name``, the path from
    ``base``), nested ones too."""
    classes, functions = {}, {}
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                where = f"{path.relative_to(base)}:{getattr(node, 'name', '')}"
                if isinstance(node, ast.ClassDef):
                    classes[where] = lines
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions[where] = max(lines, functions.get(where, 0))
    return classes, functions


def test_no_function_over_60_lines_and_no_class_over_300():
    classes, functions = definition_sizes([REPO / "megatron_pec", REPO / "benchmarks"])
    assert {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES} == {}
    assert {c: n for c, n in classes.items() if n > MAX_CLASS_LINES} == {}


def test_the_size_check_counts_nested_definitions(tmp_path):
    (tmp_path / "made_up.py").write_text("class C:\n    def f(self):\n" + "        x = 1\n" * 70)
    assert definition_sizes([tmp_path], tmp_path) == ({"made_up.py:C": 72}, {"made_up.py:f": 71})


STEP_LIST = re.compile(r"^(\d+)\. \*\*([a-z ]+)\*\*", re.MULTILINE)
STEP_MENTION = re.compile(r"\b(save|load) steps? (\d+)(?:-(\d+))?(?:, ([a-z][a-z ]*[a-z]))?", re.IGNORECASE)


def design_steps() -> dict[str, dict[int, str]]:
    """"save" / "load" -> step number -> name, from docs/design.md's numbered lists of the two paths."""
    text = (REPO / "docs" / "design.md").read_text()
    out = {}
    for path in ("save", "load"):
        section = text.split(f"## The {path} path", 1)[1].split("\n## ", 1)[0]
        out[path] = {int(n): name for n, name in STEP_LIST.findall(section)}
    return out


def step_mentions(text: str) -> list[tuple[str, int, int, str | None]]:
    """(path, first step, last step, the name given after a single step or None) of each mention."""
    return [(path.lower(), int(first), int(last or first), name or None)
            for path, first, last, name in STEP_MENTION.findall(text)]


def drifted_steps(text: str, steps: dict[str, dict[int, str]]) -> list[str]:
    """The step mentions in ``text`` that name no step of ``steps``, or a step by another name."""
    wrong = []
    for kind, first, last, name in step_mentions(text):
        named = steps[kind].get(first)
        if last not in steps[kind] or named is None or (name and first == last and not name.lower().startswith(named)):
            wrong.append(f"{kind} step {first}-{last} {name!r} (design: {named!r})")
    return wrong


def test_step_numbers_and_names_agree_with_the_design_everywhere():
    """One numbering of the save and load steps: every "save step N" / "load steps N-M" in the package and
    the design names a step of docs/design.md's lists, and a name given with a step is that step's."""
    steps = design_steps()
    assert sorted(steps["save"]) == list(range(1, 9)) and sorted(steps["load"]) == list(range(1, 8)), steps
    wrong = {str(path.relative_to(REPO)): drifted_steps(path.read_text(), steps)
             for path in [*PACKAGE.rglob("*.py"), REPO / "docs" / "design.md"]}
    assert not {path: w for path, w in wrong.items() if w}


def test_the_step_check_sees_a_drifted_name_and_a_step_that_does_not_exist():
    steps = design_steps()
    assert step_mentions("load steps 3-5 without") == [("load", 3, 5, None)]
    assert drifted_steps('"""Save step 4, describe and hand over: ...', steps) == []
    assert drifted_steps('"""Save step 4, notify: ...', steps) == ["save step 4-4 'notify' (design: 'describe and "
                                                                   "hand over')"]
    assert drifted_steps("(load step 9)", steps) == ["load step 9-9 None (design: None)"]


def protocol_members(path: Path, protocol: str) -> set[str]:
    """The attributes and methods the ``Protocol`` class ``protocol`` in ``path`` declares."""
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == protocol]
    return {n.target.id if isinstance(n, ast.AnnAssign) else n.name for n in cls.body
            if isinstance(n, (ast.AnnAssign, ast.FunctionDef))}


def class_members(path: Path, name: str) -> set[str]:
    """What instances of class ``name`` in ``path`` have: its methods and properties, and what its methods
    assign to ``self``."""
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assigned = {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                for t in ([t] if not isinstance(t, ast.Tuple) else t.elts)
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return methods | assigned


def test_the_megatron_adapter_is_what_a_save_and_a_restore_are_typed_by():
    """The save and the restore each type the adapter by a protocol of what they use of it; the Megatron
    adapter has every member of both (a new use must be declared where it is used)."""
    adapter = class_members(PACKAGE / "megatron" / "adapter.py", "MegatronAdapter")
    for path, protocol in ((PACKAGE / "save" / "save.py", "SaveAdapter"),
                           (PACKAGE / "restore" / "restore.py", "RestoreAdapter")):
        members = protocol_members(path, protocol)
        assert members and members <= adapter, (protocol, sorted(members - adapter))

"""The package's shape, checked from its source with `ast`: no import cycle inside `autotune/`,
imports flow one way through the layers below, no file grows past a size a newcomer can read, no
test hook lives in production code, and no test module imports another (tests/helpers holds what
they share). And the linter (ruff, pyproject's [tool.ruff]) finds nothing.

Every import counts, those inside functions too (a deferred import is still a dependency); those
under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
# A file's length is a hint, not a rule that shapes the code (split by concept, not by count): past
# this no newcomer reads one through. Lines as `ruff format` writes them.
MAX_LINES = 800

# Data flows down this list: a module may import modules of its own layer's unit (its subpackage,
# or itself) and of any layer below, never of a layer above. Units of one layer do not import each
# other unless listed in SIDEWAYS.
LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},  # the command line: flags parsed (`serve` starts the service)
    {"service"},  # the service: requests read as the same flags (autotune/flags)
    {"render"},  # what people and scripts read: tables, JSON, the live line, plots, Markdown
    {"train"},  # the fine-tune (searching first if need be)
    {"recipe_files"},  # the user's TRL/axolotl/LLaMA-Factory file: a recipe in, a winner back
    {"handoff", "planner"},  # a study's winner handed off; a space predicted for a card (plan)
    {"search"},  # space -> strategies -> probe runner -> store; the queue worker
    {"flags"},  # every command's flags, one row each: both doors read requests with them
    {"estimate"},  # memory predicted by tracing the probe's own training step
    {"probe", "store", "data", "launchers"},  # measuring, keeping, the user's data; starting workers
    {"specs"},  # models and cards as data
    {"host", "levers", "results"},  # this machine; what a config is; what a probe measured
    {"vocabulary"},  # errors, statuses, defaults, units: the words everyone shares
]
# (importer unit, imported unit) pairs allowed within one layer: none; a new one needs its reason here.
SIDEWAYS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str) -> set[str]:
    """The autotune modules `name` imports at run time."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from autotune.x import y` imports the module autotune.x.y when there is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def unit(name: str) -> str:
    return name.split(".")[1] if "." in name else "__init__"


def layer(name: str) -> int:
    u = unit(name)
    for index, units in enumerate(LAYERS):
        if u in units:
            return index
    raise AssertionError(f"{name}: its unit {u!r} is in no layer of tests/test_layout.py; give it one")


def test_no_import_cycle_inside_the_package():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_imports_flow_down_the_layers():
    wrong = []
    for name, targets in GRAPH.items():
        if name == "autotune":  # the package face re-exports from below
            continue
        for target in targets:
            if target == "autotune":
                wrong.append(f"{name} imports the package face `autotune` (import the module that defines the name)")
                continue
            same_unit = unit(name) == unit(target)
            if same_unit or layer(target) > layer(name) or (unit(name), unit(target)) in SIDEWAYS:
                continue
            wrong.append(f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_the_face_of_its_own_package():
    # A submodule importing its package's __init__ re-enters a half-initialised package.
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if MODULES[target].name == "__init__.py" and name.startswith(target + ".")
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_names_its_siblings_through_its_package():
    # `from autotune.handoff import ranks` inside autotune/handoff goes through the package's
    # __init__, which may still be importing this very module: name the sibling itself
    # (`import autotune.handoff.ranks as ranks`, or `from autotune.handoff.ranks import x`).
    wrong = []
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        if path.name == "__init__.py" or package == "autotune":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == package:
                wrong.append(f"{name}:{node.lineno}: from {package} import ...")
    assert not wrong, "\n".join(wrong)


def test_no_file_is_longer_than_a_newcomer_reads():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these: {long}"


def test_no_test_hook_in_production_code():
    hooks = [str(p) for p in MODULES.values() if "AUTOTUNE_TEST" in p.read_text() or "AUTOTUNE_INJECT" in p.read_text()]
    assert not hooks, f"test hooks belong in tests/ (see tests/helpers/faults): {hooks}"


TESTS = Path(__file__).resolve().parent


def _test_modules_imported(path: Path) -> set[str]:
    """The test modules (test_*.py) and conftest files that `path` imports: helpers live in
    tests/helpers, fixtures in conftest.py, where pytest finds them itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found |= {
            name
            for name in names
            if name.startswith("tests.") and (name.rpartition(".")[2].startswith("test_") or name.endswith("conftest"))
        }
    return found


def test_no_test_module_imports_another_test_module():
    reaching = {
        str(p.relative_to(TESTS.parent)): sorted(imported)
        for p in sorted(TESTS.rglob("*.py"))
        if (imported := _test_modules_imported(p))
    }
    assert not reaching, f"move what these take into tests/helpers: {reaching}"


def test_the_check_sees_a_test_module_imported(tmp_path):
    reaching = tmp_path / "test_x.py"
    reaching.write_text(
        "import tests.search.test_faults\nfrom tests.train.conftest import STUDY\n"
        "from tests.helpers.cli import invoke\n"
    )
    assert _test_modules_imported(reaching) == {"tests.search.test_faults", "tests.train.conftest"}


def test_the_check_sees_a_cycle_and_an_upward_import(monkeypatch):
    """The checks above can fail: a deliberately bad graph trips both."""
    bad = {"autotune.store.store": {"autotune.search.driver"}, "autotune.search.driver": {"autotune.store.store"}}
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", {**GRAPH, **bad})

    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycle_inside_the_package()
    with pytest.raises(AssertionError, match="autotune.store.store \\(layer 10\\) imports autotune.search.driver"):
        test_imports_flow_down_the_layers()


# (lines as `ruff format` writes them: a call of many arguments takes one line each)
MAX_FUNCTION_LINES = 140


def _functions():
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


def test_no_function_is_longer_than_a_newcomer_reads():
    long = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, node in _functions()
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, f"split these into named steps: {long}"


STATUS_WORDS = {"ok", "oom", "error", "timeout", "crashed", "unstable", "skipped"}


def _names_a_status(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return "status" in text.split("(")[0].lower()


def status_literals(tree: ast.AST) -> list[str]:
    """Comparisons of a status with a string literal (`result.status == "ok"`), as source text."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = [s for s in sides if isinstance(s, ast.Constant) and s.value in STATUS_WORDS]
        literals += [
            e
            for s in sides
            if isinstance(s, (ast.Tuple, ast.List, ast.Set))
            for e in s.elts
            if isinstance(e, ast.Constant) and e.value in STATUS_WORDS
        ]
        if literals and any(_names_a_status(s) for s in sides):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_statuses_are_compared_as_members_not_as_strings():
    # `result.status == "ok"` reads the same as ProbeStatus.OK until a status is renamed; one
    # vocabulary (autotune/vocabulary/status.py), used by name.
    found = [
        f"{name}:{line}" for name, path in MODULES.items() for line in status_literals(ast.parse(path.read_text()))
    ]
    assert not found, "compare with autotune.vocabulary.status members:\n" + "\n".join(found)
    assert status_literals(ast.parse('ok = row["status"] in ("ok", "oom") or result.status != "skipped"')) == [
        "1: row['status'] in ('ok', 'oom')",
        "1: result.status != 'skipped'",
    ]


def test_every_probe_setting_reaches_a_joining_worker():
    """A study's plan carries every probe setting but the worker's own (device) and the study's
    (margin): derived from ProbeSettings' fields, it cannot drop one, and this shows it through
    the whole trip (the plan stored as JSON, read back by a worker)."""
    import dataclasses
    import json

    from autotune.probe.settings import ProbeSettings
    from autotune.search.study_plan import StudyPlan

    changed = ProbeSettings(
        device="cuda:1",
        warmup_steps=3,
        measure_steps=4,
        measure_seconds=1.5,
        timeout=77.0,
        margin=123,
        trust_remote_code=True,
        max_compile_seconds=9.0,
        rendezvous="10.0.0.1:29500",
    )
    untouched = [
        f.name
        for f in dataclasses.fields(ProbeSettings)
        if getattr(changed, f.name) == getattr(ProbeSettings(), f.name)
    ]
    assert not untouched, f"give these a non-default value above: {untouched}"
    stored = json.loads(json.dumps(StudyPlan(probe=changed.to_plan()).to_dict()))
    joined = ProbeSettings.from_plan(StudyPlan.from_dict(stored).probe, device="cuda:1", margin=123)
    assert joined == dataclasses.replace(changed, rendezvous=None)  # (where this node's ranks meet is its own)
    assert set(changed.to_plan()) | ProbeSettings.WORKER_OWN == {f.name for f in dataclasses.fields(ProbeSettings)}


def test_the_linter_finds_nothing_and_the_code_is_formatted():
    """pyflakes' checks over the code, the tests and the benchmarks (an unused import or an
    undefined name is a question a reader should not have to ask), and the formatter's layout."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed: pip install -e '.[dev]'")
    root = PACKAGE.parent
    for command in (["check", "--output-format", "concise"], ["format", "--check"]):
        done = subprocess.run(
            [ruff, *command, "--no-cache", "autotune", "tests", "benchmarks"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]

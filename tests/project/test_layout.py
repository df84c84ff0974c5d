"""The house as design.md draws it: the root shows what a user runs, everything else is the package hcstudy, whose
imports form a tree that never reaches the trainer, whose every module docs/architecture.md names, and whose every
module has its test file, named for it (tests/README.md)."""
import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hcstudy"
ROOT_ENTRIES = {"train_c4.py", "report.py", "torchrun.py", "run_experiments.sh", "setup.sh", "requirements.txt",
                "requirements-dev.txt", "requirements-gpu.txt", "requirements-lock.txt", "README.md", "LICENSE",
                ".gitignore", ".ci", "hcstudy", "tests", "docs", "benchmarks", "slurm", "data"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    files = [*PACKAGE.rglob("*.py"), ROOT / "train_c4.py", ROOT / "report.py", ROOT / "torchrun.py"]
    return {module_name(path): path for path in files if "__pycache__" not in path.parts}


def imported(path: Path, modules: dict) -> set[str]:
    """The project modules `path` imports anywhere in it (in functions too): `from a.b import c` is a.b.c where c is
    a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                      for alias in node.names}
    return found & set(modules)


def test_the_root_holds_only_what_a_user_runs():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    entries = {line.split("/")[0] for line in tracked.splitlines()}
    assert entries <= ROOT_ENTRIES, entries - ROOT_ENTRIES
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["report.py", "torchrun.py", "train_c4.py"]


def test_the_package_never_imports_the_trainer_and_its_imports_form_a_tree():
    modules = project_modules()
    graph = {name: imported(path, modules) - {name} for name, path in modules.items()}
    reaching_trainer = [name for name in graph if name.startswith("hcstudy") and "train_c4" in graph[name]]
    assert not reaching_trainer
    state, circles = {}, []

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circles.append(path + [other])
            elif other not in state:
                visit(other, path + [other])
        state[name] = "done"
    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles


def test_the_package_map_names_every_module():
    """docs/architecture.md is the one map of the package: a module it does not name is a module nobody finds."""
    map_text = (ROOT / "docs" / "architecture.md").read_text()
    named = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
             if path.name not in ("__init__.py", "__main__.py") or path.parent.name == "arms"}
    assert not {name for name in named if name not in map_text}


# a module's tests where the file is not named for the module: the registry is the arms package's __init__; the
# trainer and report.py, the two commands, have their end-to-end files
NAMED_FOR = {"hcstudy/arms/__init__.py": "tests/arms/test_registry.py", "train_c4.py": "tests/trainer/test_train.py",
             "report.py": "tests/report/test_report.py"}


def holds_code(path: Path) -> bool:
    """Whether a module does more than say what its package is (a docstring, imports, ROOT) or run another
    module's main (__main__.py): those have nothing of their own to test."""
    if path.name == "__main__.py":
        return False
    body = ast.parse(path.read_text()).body
    return any(not isinstance(node, (ast.Expr, ast.Import, ast.ImportFrom, ast.Assign)) for node in body)


def file_named_for(path: Path) -> str | None:
    """The test file named for a module: tests/<sub-package>/test_<module>.py for a sub-package's module (so that
    tests/report/ mirrors hcstudy/report/), tests/<any area>/test_<module>.py for a module of hcstudy itself."""
    relative = path.relative_to(ROOT).as_posix()
    if relative in NAMED_FOR:
        return NAMED_FOR[relative] if (ROOT / NAMED_FOR[relative]).is_file() else None
    parts = path.relative_to(PACKAGE).parts
    found = (sorted((ROOT / "tests").glob(f"*/test_{path.stem}.py")) if len(parts) == 1 else
             [ROOT / "tests" / parts[0] / f"test_{path.stem}.py"])
    return next((f.relative_to(ROOT).as_posix() for f in found if f.is_file()), None)


def modules_to_test() -> list[Path]:
    return sorted(path for path in [*PACKAGE.rglob("*.py"), ROOT / "train_c4.py", ROOT / "report.py"]
                  if "__pycache__" not in path.parts and holds_code(path))


def test_every_module_has_its_test_file():
    untested = {path.relative_to(ROOT).as_posix() for path in modules_to_test() if file_named_for(path) is None}
    assert untested == set()


def test_a_module_of_code_and_a_misplaced_test_file_are_seen():
    """The rule's own two halves: a module holding a function needs a file, and a sub-package's module is not
    covered by a same-named file of another area."""
    module = PACKAGE / "report" / "runs.py"
    assert holds_code(module) and not holds_code(PACKAGE / "launcher" / "__main__.py")
    assert file_named_for(module) == "tests/report/test_runs.py"
    assert file_named_for(PACKAGE / "planner" / "gpus.py") == "tests/planner/test_gpus.py"
    assert file_named_for(PACKAGE / "report" / "no_such_module.py") is None
    assert file_named_for(PACKAGE / "no_such_module.py") is None


def test_the_trainer_holds_no_kernel_and_no_model():
    """The model (the spec) and the arms' formulas live in the package; the trainer builds them and trains."""
    source = (ROOT / "train_c4.py").read_text()
    assert "autograd.Function" not in source
    assert not [node.name for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ClassDef) and any(getattr(b, "attr", "") == "Module" for b in node.bases)]


@pytest.mark.slow
def test_every_test_worker_collects_the_same_tests():
    """pytest -n hands tests to workers by name, and each worker collects on its own: a name made of the clock (a
    gzip header's time) or of set order (the hash seed) stops the whole suite before one test runs."""
    def collected(hash_seed: str) -> list[str]:
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                              cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return [line for line in done.stdout.splitlines() if "::" in line]

    first = collected("1")
    time.sleep(1.1)  # the next second: gzip headers and timestamps differ
    assert collected("2") == first

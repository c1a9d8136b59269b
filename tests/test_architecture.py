"""The never-rules of docs/architecture.md hold, and each check fails on a planted violation.

import-linter checks the layers, io_engine's independence, the CLI above the library and the
absence of cycles (pyproject.toml, [tool.importlinter]); an `ast` walk checks what it cannot
express: imports across packages go through the package's face, no `_private` name is imported
from another module, function-level imports only for optional dependencies and the CLI
dispatcher; that the optimizer and checkpoints reach placement only through the runtime (one way
in, checked by both); that the runtime reaches placement through its narrow interface (the
names PLACEMENT_INTERFACE, no field of the manager: checked by both); and a fresh interpreter
shows that importing the config loads no torch.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from builders import REPO

OPTIONAL = {"transformers", "accelerate", "peft", "tomllib"}
"""Optional dependencies, imported where first needed."""
FUNCTION_LEVEL_ALLOWED = {
    ("tierzero/config/machine.py", "torch"), ("tierzero/config/machine.py", "psutil"),  # config stays torch-free
    ("tierzero/hf/__init__.py", "tierzero.hf.trainer"),  # tierzero.hf.Trainer needs transformers
}
"""(file, module) function-level imports allowed besides OPTIONAL and the CLI dispatcher."""
DISPATCHER = "tierzero/cli/dispatch.py"
THROUGH_THE_RUNTIME = ("optim", "checkpoint")
"""Packages that reach placement only through the runtime: they never import tierzero.placement."""
PLACEMENT_INTERFACE = {"PlacementManager", "Tier", "Kind", "TensorHandle", "TensorRecord", "Residency", "CopyEvent",
                       "DeviceCopies", "StepRecorder", "StepStats", "CheckpointHome", "Segment", "UPDATES_TRACK",
                       "ACTIVATIONS_TRACK"}
"""What the runtime may import of tierzero.placement: the manager's face, the handles and
records it hands out, and the protocols of the streams and telemetry it passes through."""
PLACEMENT_FIELDS = {"streams", "telemetry", "pool", "device_pool", "swap", "budgets"}
"""The manager's fields the runtime never reads (PlacementManager.copies, .recorder, .host_room()
and .borrow instead)."""

def lint_imports(root: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def _function_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                walk(child, True)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                if inside:
                    out.append(child)
            else:
                walk(child, inside)

    walk(tree, False)
    return out


def ast_violations(root: Path) -> list[str]:
    """Every breach of the rules the `ast` walk checks, as 'file:line: what'."""
    found = []
    for path in sorted((root / "tierzero").rglob("*.py")) + sorted((root / "io_engine").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        package = parts[1] if parts[0] == "tierzero" and len(parts) > 2 else None
        tree = ast.parse(path.read_text(), rel)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            mod = node.module.split(".")
            if mod[0] == "tierzero" and len(mod) > 2 and package is not None and mod[1] != package:
                found.append(f"{rel}:{node.lineno}: imports {node.module} past the face of tierzero.{mod[1]}")
            if mod[0] in ("tierzero", "io_engine"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{rel}:{node.lineno}: imports the private name {alias.name} of {node.module}")
        for node in _function_level(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if rel == DISPATCHER or name.split(".")[0] in OPTIONAL or (rel, name) in FUNCTION_LEVEL_ALLOWED:
                    continue
                found.append(f"{rel}:{node.lineno}: imports {name} inside a function")
    return found


def io_engine_face_violations(root: Path) -> list[str]:
    """Imports of io_engine's modules past its face in tierzero and the benchmarks, as 'file:line: what'
    (`from io_engine import bench` is the face's one named module; tests may patch its modules)."""
    found = []
    for path in sorted((root / "tierzero").rglob("*.py")) + sorted((root / "benchmarks").glob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            found += [f"{rel}:{node.lineno}: imports {n} past the face of io_engine"
                      for n in names if n.startswith("io_engine.")]
    return found


def one_way_in_violations(root: Path) -> list[str]:
    """In the packages THROUGH_THE_RUNTIME, imports of tierzero.placement at any level and reads
    of the placement manager off a runtime object (`.pm`, `placement_manager`), as 'file:line: what'."""
    found = []
    for package in THROUGH_THE_RUNTIME:
        for path in sorted((root / "tierzero" / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Attribute) and node.attr in ("pm", "placement_manager"):
                    found.append(f"{rel}:{node.lineno}: reads the placement manager ({node.attr}), not through the runtime")
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if any(n == "tierzero.placement" or n.startswith("tierzero.placement.") for n in names):
                    found.append(f"{rel}:{node.lineno}: imports tierzero.placement, not through the runtime")
    return found


def placement_interface_violations(root: Path) -> list[str]:
    """In tierzero/runtime: names imported from tierzero.placement outside PLACEMENT_INTERFACE,
    and reads of PLACEMENT_FIELDS off the placement manager (`pm.X`, `<obj>.pm.X`,
    `placement_manager(...).X`), as 'file:line: what'."""
    found = []
    for path in sorted((root / "tierzero" / "runtime").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ImportFrom) and node.module == "tierzero.placement":
                found += [f"{rel}:{node.lineno}: imports {a.name}, not placement's interface"
                          for a in node.names if a.name not in PLACEMENT_INTERFACE]
            if isinstance(node, ast.Attribute) and node.attr in PLACEMENT_FIELDS:
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id == "pm" or isinstance(owner, ast.Attribute)
                        and owner.attr == "pm" or isinstance(owner, ast.Call) and getattr(owner.func, "attr",
                        getattr(owner.func, "id", None)) == "placement_manager"):
                    found.append(f"{rel}:{node.lineno}: reads the placement manager's {node.attr}, "
                                 "past its interface")
    return found


def placement_modules(root: Path) -> set[str]:
    """placement's modules and sub-packages (a contract naming a package forbids what is in it)."""
    folder = root / "tierzero" / "placement"
    return ({f"tierzero.placement.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
            | {f"tierzero.placement.{p.parent.name}" for p in folder.glob("*/__init__.py")})


def tree_copy(tmp_path: Path) -> Path:
    for name in ("tierzero", "io_engine"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(root: Path, file: str, line: str, *, inside_function: bool = False) -> None:
    path = root / file
    text = path.read_text()
    if inside_function:
        line = f"\n\ndef _planted() -> None:\n    {line}\n"
    path.write_text(text + "\n" + line + "\n")


def test_the_contracts_hold() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_ast_rules_hold() -> None:
    assert ast_violations(REPO) == []


def test_io_engine_is_imported_through_its_face() -> None:
    assert io_engine_face_violations(REPO) == []


def test_the_optimizer_and_checkpoints_reach_placement_through_the_runtime() -> None:
    assert one_way_in_violations(REPO) == []


def test_the_runtime_reaches_placement_through_its_interface() -> None:
    assert placement_interface_violations(REPO) == []
    # the contract forbids every module of placement (a new one too), the package's face allowed
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c.get("source_modules") == ["tierzero.runtime"]]
    assert set(contract["forbidden_modules"]) == placement_modules(REPO), contract


@pytest.mark.parametrize("line", ["from tierzero.placement import CopyStreams", "x = ctx.pm.streams",
                                  "y = pm.telemetry.spans", "z = runtime.placement_manager(m).swap"])
def test_a_planted_reach_past_placements_interface_is_found(tmp_path: Path, line: str) -> None:
    root = tree_copy(tmp_path)
    plant(root, "tierzero/runtime/flat/gathers.py", line, inside_function=True)
    found = placement_interface_violations(root)
    assert len(found) == 1 and found[0].startswith("tierzero/runtime/flat/gathers.py"), found


def test_the_config_imports_no_torch() -> None:
    code = "import sys, tierzero.config; assert 'torch' not in sys.modules, 'tierzero.config imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                   timeout=60)


@pytest.mark.parametrize("file,line,inside,broken", [
    # a function-level import upward counts like any other
    ("tierzero/placement/storage/tiers.py", "from tierzero.runtime import wrap", True, "layers"),
    # TYPE_CHECKING imports too
    ("tierzero/layout/zero.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tierzero.optim import AdamW",
     False, "layers"),
    ("io_engine/sizes.py", "import tierzero", False, "io_engine never imports tierzero"),
    ("tierzero/hf/pretrained.py", "from tierzero.cli import main", True, "the library never imports the command line"),
    # a cycle inside one package: blocks imports wrapping, which imports blocks
    ("tierzero/runtime/blocks.py", "from tierzero.runtime import wrapping", True, "no import cycle"),
    ("tierzero/optim/clip.py", "from tierzero.placement import Kind", True, "reach placement only through the runtime"),
    ("tierzero/runtime/flat/gathers.py", "from tierzero.placement import residency", True, "placement through its face"),
], ids=["upward-in-function", "upward-type-checking", "io_engine", "library-cli", "cycle", "one-way-in",
        "runtime-past-placements-face"])
def test_a_planted_import_breaks_its_contract(tmp_path: Path, file: str, line: str, inside: bool, broken: str) -> None:
    root = tree_copy(tmp_path)
    plant(root, file, line, inside_function=inside)
    result = lint_imports(root)
    assert result.returncode != 0, result.stdout
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout


@pytest.mark.parametrize("file,line,inside,what", [
    ("tierzero/runtime/flat/grads.py", "from tierzero.placement.manager import PlacementManager", False, "past the face"),
    ("tierzero/cli/train.py", "from tierzero.cli.harness import _unknown", False, "private name"),
    ("tierzero/optim/clip.py", "import json", True, "inside a function"),
], ids=["past-the-face", "private-name", "function-level"])
def test_a_planted_breach_is_found(tmp_path: Path, file: str, line: str, inside: bool, what: str) -> None:
    root = tree_copy(tmp_path)
    plant(root, file, line, inside_function=inside)
    found = ast_violations(root)
    assert len(found) == 1 and what in found[0] and found[0].startswith(file), found


@pytest.mark.parametrize("line", ["from io_engine.files import free_disk_bytes", "import io_engine.sizes"])
def test_a_planted_import_past_io_engines_face_is_found(tmp_path: Path, line: str) -> None:
    root = tree_copy(tmp_path)
    plant(root, "tierzero/checkpoint/export.py", line)
    found = io_engine_face_violations(root)
    assert len(found) == 1 and "past the face of io_engine" in found[0], found
    assert found[0].startswith("tierzero/checkpoint/export.py"), found


@pytest.mark.parametrize("file,line", [
    ("tierzero/optim/adamw.py", "from tierzero.placement import Kind"),
    ("tierzero/checkpoint/export.py", "from tierzero import placement"),
    ("tierzero/checkpoint/reshard.py", "import tierzero.placement.handles"),
    ("tierzero/optim/clip.py", "runtime.state_of(model).pm.settle()"),
    ("tierzero/checkpoint/save_load.py", "runtime.placement_manager(model)"),
], ids=["optim-from", "checkpoint-package", "checkpoint-module", "optim-pm", "checkpoint-placement-manager"])
def test_a_planted_import_of_placement_is_found(tmp_path: Path, file: str, line: str) -> None:
    root = tree_copy(tmp_path)
    plant(root, file, line, inside_function=True)
    found = one_way_in_violations(root)
    assert len(found) == 1 and found[0].startswith(file) and "not through the runtime" in found[0], found

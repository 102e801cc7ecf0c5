"""Rules the library keeps as it grows: small functions, device-agnostic code, safe loading, servers on loopback.

Each rule is checked on the source tree (AST where it matters), and each checker is shown to catch a violation.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "eagle"
MAX_FUNCTION_LINES = 60
# EaModel is the reference API over the engine: a thin facade.
MAX_FACADE_LINES = 200
# The one module allowed to call CUDA-specific synchronisation (it checks the device first).
DEVICE_HELPER = PACKAGE / "utils" / "device.py"
# torch.load calls allowed without weights_only=True, each with its reason.
TRUSTED_PICKLES = {
    "eagle/traineagle3/resume.py": "a ZeRO optimizer state written by DeepSpeed holds DeepSpeed objects; DeepSpeed's "
                                   "own load_checkpoint unpickles the same files of a run being resumed",
}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method whose definition spans more than ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append((node.name, length))
    return found


def unsafe_torch_loads(source: str) -> list[int]:
    """Line numbers of ``torch.load(...)`` calls without ``weights_only=True``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            if not safe:
                lines.append(node.lineno)
    return lines


def device_specific_calls(source: str) -> list[str]:
    """``.cuda()`` calls and ``torch.cuda.synchronize`` uses (outside the device helper they are not allowed)."""
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    return re.findall(r"\.cuda\(\)|torch\.cuda\.synchronize", code)


def test_no_function_longer_than_the_limit():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{name} ({length} lines)"
                 for path in _sources() for name, length in long_functions(path.read_text())]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: {offenders}"


def class_lines(source: str, name: str) -> int:
    """Lines spanned by the class ``name`` defined at the top of ``source``."""
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name]
    return node.end_lineno - node.lineno + 1


def test_ea_model_is_a_thin_facade():
    lines = class_lines((PACKAGE / "model" / "ea_model.py").read_text(), "EaModel")
    assert lines < MAX_FACADE_LINES, f"EaModel spans {lines} lines; its work belongs in the engine"
    assert class_lines("class A:\n    x = 1\n\n    y = 2\n", "A") == 4


def test_long_function_checker_catches_one():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions("def g():\n    return 1\n") == []


def test_torch_load_is_always_weights_only():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}"
                 for path in _sources() if str(path.relative_to(PACKAGE.parent)) not in TRUSTED_PICKLES
                 for line in unsafe_torch_loads(path.read_text())]
    assert not offenders, f"torch.load without weights_only=True: {offenders}"
    assert unsafe_torch_loads("import torch\ntorch.load(p)\n") == [2]
    assert unsafe_torch_loads("import torch\ntorch.load(p, weights_only=False)\n") == [2]
    assert unsafe_torch_loads("import torch\ntorch.load(p, weights_only=True)\n") == []


def test_library_code_is_device_agnostic():
    offenders = {str(path.relative_to(PACKAGE.parent)): calls for path in _sources() if path != DEVICE_HELPER
                 for calls in [device_specific_calls(path.read_text())] if calls}
    assert not offenders, f"device-specific calls outside eagle/utils/device.py: {offenders}"
    assert device_specific_calls("x = y.cuda()\ntorch.cuda.synchronize()\n") == [".cuda()", "torch.cuda.synchronize"]


def test_no_remote_code_is_trusted_by_default():
    pattern = re.compile(r"trust_remote_code\s*=\s*True")
    offenders = [str(path.relative_to(PACKAGE.parent)) for path in _sources() if pattern.search(path.read_text())]
    assert not offenders, f"trust_remote_code=True hard-coded in {offenders}"


@pytest.mark.parametrize("module", ["eagle.application.webui", "eagle.application.server"])
def test_servers_bind_to_loopback_by_default(module):
    import importlib

    mod = importlib.import_module(module)
    assert mod.parse_args([]).host == "127.0.0.1"


# Folder names that common global git ignore files list (Rust and Maven's target/, build outputs, dependency
# folders): a new file in a package folder of such a name would silently stay out of a commit.
COMMONLY_IGNORED_FOLDERS = {"target", "build", "dist", "out", "bin", "obj", "node_modules", "vendor", "venv", "env",
                            "tmp", "cache", "logs"}


def commonly_ignored_folders(root: Path) -> list[str]:
    """Folders under ``root`` whose name a global git ignore file commonly lists."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_dir() and p.name in COMMONLY_IGNORED_FOLDERS)


def test_no_package_folder_has_a_commonly_ignored_name():
    assert commonly_ignored_folders(PACKAGE) == []


def test_ignored_folder_checker_catches_one(tmp_path):
    (tmp_path / "model" / "target").mkdir(parents=True)
    assert commonly_ignored_folders(tmp_path) == ["model/target"]

"""The house rules, read from the source: import layers, file sizes, function complexity, and the map.

The layers (bottom first) are the ones docs/architecture.md draws. A module may import only from a
lower layer, or from its own package. The optional C extensions sit at the bottom.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest

import layertap

SRC = Path(layertap.__file__).parent
ROOT = SRC.parent.parent

# bottom first; a name is a module or a package (all of its files)
LAYERS: list[set[str]] = [
    {"printable", "units", "nested", "records", "workers", "shapes", "_copy", "_moments"},
    {"errors", "tensorstats"},
    {"tables", "progress", "atomic", "allocator", "distributed", "select", "attention_weights", "hfcode"},
    {"modelinfo"},
    {"images"},
    {"overlay", "data"},
    {"loading"},
    {"tap"},
    {"runtime"},
    {"features"},
    {"store"},
    {"stats", "summary", "attention", "tokenloader"},
    {"_watch"},
    {"nonfinite", "watch", "cam"},
    {"extract"},
    {"report"},
    {"demo"},
    {"cli"},
    {"__init__", "__main__"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    """Dotted name below layertap -> file, for every Python file of the package."""
    return {".".join(p.relative_to(SRC).with_suffix("").parts): p for p in sorted(SRC.rglob("*.py"))}


def _unit(module: str) -> str:
    """The layer unit of a module: its top-level name below layertap (a package counts whole)."""
    return module.split(".")[0]


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted target below layertap) for every import of layertap code in ``path``, lazy ones too."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if module == "__init__":
        package = []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "layertap":
                target = node.module.split(".")[1:]
            else:
                continue
            if target:
                found.append((node.lineno, ".".join(target)))
            else:  # from . import a, b: each name is a module of the package
                found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, ".".join(a.name.split(".")[1:])) for a in node.names if a.name.startswith("layertap.")]
    return found


def test_every_module_has_a_layer():
    units = {_unit(m) for m in _modules()}
    units |= {p.name.split(".")[0] for p in SRC.glob("*.so")}
    assert sorted(units - set(LAYER_OF)) == [], "give the new module a layer here and in docs/architecture.md"


def test_no_module_imports_one_above_it():
    upward = []
    for module, path in _modules().items():
        own = _unit(module)
        for line, target in _imports(module, path):
            unit = _unit(target)
            if unit == own or unit not in LAYER_OF:
                continue
            if LAYER_OF[unit] >= LAYER_OF[own]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({own}, layer {LAYER_OF[own]}) imports {target} (layer {LAYER_OF[unit]})")
    assert upward == []


def test_no_helper_of_the_tap_imports_its_core():
    # tap/core.py composes the helpers (kept, inplace, copies, grads, ops, ...); a helper that imported it
    # back would be a cycle in disguise
    back = [
        f"{path.relative_to(ROOT)}:{line}"
        for module, path in _modules().items()
        if module.startswith("tap.") and module not in ("tap.core", "tap.__init__")
        for line, target in _imports(module, path)
        if target == "tap.core"
    ]
    assert back == []


def test_no_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values() if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_no_function_over_complexity_25():
    radon = pytest.importorskip("radon.complexity", reason="radon is in the test extra")  # installed by `make setup`
    complex_ = [
        f"{p.relative_to(ROOT)}:{block.lineno} {block.fullname} {block.complexity}"
        for p in _modules().values()
        for block in radon.cc_visit(p.read_text())
        if block.complexity > 25
    ]
    assert complex_ == []


def test_tap_init_is_small():
    from layertap.tap.core import Tap

    tree = ast.parse(Path(importlib.import_module("layertap.tap.core").__file__).read_text())
    init = next(
        n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == Tap.__name__
        for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )  # fmt: skip
    assert init.end_lineno - init.lineno + 1 < 50


def test_architecture_md_names_every_file():
    text = (ROOT / "docs" / "architecture.md").read_text()
    files = [p.relative_to(SRC).as_posix() for p in sorted(SRC.rglob("*")) if p.is_file() and p.suffix in (".py", ".c", ".pyi", ".h", ".html", ".pt")]
    missing = [f for f in files if not re.search(rf"(?<![\w/.]){re.escape(f)}(?![\w])", text)]
    assert missing == []


def test_no_test_helper_hides_an_installed_package():
    """tests/ is on sys.path: a helper module named like an installed package hides it from every
    import (``tests/kernels.py`` hid the ``kernels`` package transformers 5.25 imports)."""
    installed = importlib.metadata.packages_distributions()
    helpers = [p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("test_") and p.stem != "conftest"]
    assert helpers, "no helper modules found: the test looks in the wrong folder"
    shadowing = {name: installed[name] for name in helpers if name in installed}
    assert not shadowing, f"test helpers named like installed packages: {shadowing}"

"""The package's shape, checked from its source (nothing is imported): imports only point down
the layer order that docs/architecture.md writes (read from it here, so the order has one
copy), there are no import cycles, and each lever's options are named in few modules (a lever
is one spec: the registry carries it everywhere else)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "effitrain"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MAX_MODULES_PER_LEVER_FIELD = 4
ENGLISH_WORDS = {"reference"}
"""Lever fields that are also words the code uses for other things."""


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every effitrain module ``name`` imports: at module level, inside functions, and under
    TYPE_CHECKING alike."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                prefix = base
                for _ in range(node.level - 1):
                    prefix = prefix.rpartition(".")[0]
                module = f"{prefix}.{module}" if node.module else prefix
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("effitrain") and target != name:
                out.add(target)
    return out


def layers() -> list[list[str]]:
    """The numbered list under "## Layers" in docs/architecture.md: each line's backticked
    module names, top layer first."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    order = []
    for line in section.splitlines():
        if re.match(r"\d+\. ", line):
            order.append(re.findall(r"`(effitrain[\w.]*)`", line))
    assert order, "docs/architecture.md has no numbered layer list under ## Layers"
    return order


def layer_of(module: str, order: list[list[str]]) -> int:
    """The layer of the longest listed name that is ``module`` or a package above it."""
    best = (-1, -1)
    for index, names in enumerate(order):
        for listed in names:
            if module == listed or module.startswith(listed + "."):
                best = max(best, (len(listed), index))
    assert best[1] >= 0, f"{module} is in no layer of docs/architecture.md"
    return best[1]


def test_every_module_has_a_layer_and_imports_point_down():
    known, order = modules(), layers()
    upward = []
    for name, path in known.items():
        mine = layer_of(name, order)
        for target in imports(name, path, known):
            if layer_of(target, order) < mine:
                upward.append(f"{name} (layer {mine + 1}) imports {target}")
    assert not upward, "imports that point up:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles


def test_module_names_are_unique_across_the_package():
    names: dict[str, list[str]] = {}
    for name in modules():
        if not (PACKAGE.parent / name.replace(".", "/")).is_dir():
            names.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    assert not {k: v for k, v in names.items() if len(v) > 1}


def lever_fields() -> list[str]:
    from effitrain.levers import LEVERS

    return [name for lever in LEVERS.values() for name in lever.fields]


@pytest.mark.parametrize("field", lever_fields())
def test_a_lever_field_is_named_in_few_modules(field):
    """A lever is one spec: its options are named in the config, its own module, and few
    others (a lever that depends on another, say)."""
    # A field that is an English word (``reference``) is counted where the config's is read.
    word = re.compile(
        rf"\bconfig\.{field}\b|\"{field}\"" if field in ENGLISH_WORDS else rf"\b{field}\b"
    )
    naming = sorted(name for name, path in modules().items() if word.search(path.read_text()))
    assert len(naming) <= MAX_MODULES_PER_LEVER_FIELD, naming

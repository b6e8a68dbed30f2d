"""docs/contracts.md's package map matches the tree, and no module is in an import circle.

The map is the newcomer's way in, so a stale count means a file moved without the map
saying where. Circles are found statically over every import a module names (type-only
ones and those inside functions too): a circle that only typing or laziness keeps from
failing at import time is still two concepts that each need the other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("cache", "kernels", "chatsvc", "migrations", "bench")
SOURCES = (".py", ".c", ".h")
MAP_ROW = re.compile(r"^\| `([\w/]+)/` \| (\d+) \|", re.M)


def map_counts() -> dict[str, int]:
    text = (REPO / "docs" / "contracts.md").read_text()
    section = text.split("## The map", 1)[1].split("\n## ", 1)[0]
    return {package: int(count) for package, count in MAP_ROW.findall(section)}


def source_files(folder: Path) -> int:
    return sum(1 for p in folder.iterdir() if p.is_file() and p.suffix in SOURCES)


def test_the_map_names_every_package_with_its_file_count():
    counts = map_counts()
    packages = {
        str(init.parent.relative_to(REPO))
        for root in ("cache", "kernels", "chatsvc", "migrations")
        for init in (REPO / root).rglob("__init__.py")
    }
    assert set(counts) == packages, "docs/contracts.md's map and the packages differ"
    actual = {package: source_files(REPO / package) for package in packages}
    assert counts == actual


def module_names() -> dict[str, Path]:
    names = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else known(base))
    found.discard(None)
    found.discard(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circles_finds_a_loop_and_passes_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_is_in_an_import_circle():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert circles(graph) == []

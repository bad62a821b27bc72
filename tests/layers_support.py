"""The import checker: the layers' direction and the import cycles, read from the source tree.

`tests/test_layers.py` runs both checks, and `scripts/import-cycles` (`make lint`) runs the
cycle check, so there is one checker.  It reads the source with `ast` and imports none of it.

The direction: `events` <- `storage` <- `actors` <- `gateway` <- `dgxmm`, and inside `dgxmm` the
rooms (`admin`, `engines`, `litellm`) below what wires and starts (`app`, `cli`).  Every import
counts, at module level or inside a function, absolute or relative (`violations`).

The cycles: no two modules import each other, directly or round a longer loop, whatever the
layers allow: every import counts here too, those under `if TYPE_CHECKING:` and inside
functions included, since a reader meets the loop all the same.  A cycle is reported as its
shortest loop through the first module of the group (`a -> b -> a`; `cycles`).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("events", "storage", "actors", "gateway", "dgxmm", "simulations")

_LOWER = ("events", "storage", "actors", "gateway")
# What each unit may import of ours (besides itself).  A unit is a top-level package, or for
# `dgxmm` its room (`dgxmm.admin`) or top-level module (`dgxmm.app`).
ALLOWED: dict[str, frozenset[str]] = {
    "events": frozenset(),
    "storage": frozenset({"events"}),
    "actors": frozenset({"events", "storage"}),
    "gateway": frozenset({"events", "storage", "actors"}),
    # The simulations drive the real actors and gateway; they never reach into the application.
    "simulations": frozenset(_LOWER),
    "dgxmm": frozenset(),
    "dgxmm.config": frozenset(_LOWER),
    "dgxmm.private": frozenset(),  # file modes and the auth key: the standard library only
    # `dgxmm whatif` runs the what-if engine, which runs the real actors on simulated engines.
    "dgxmm.replay": frozenset({*_LOWER, "dgxmm.config", "simulations"}),
    "dgxmm.engines": frozenset({*_LOWER, "dgxmm.config"}),
    "dgxmm.litellm": frozenset({*_LOWER, "dgxmm.config"}),
    "dgxmm.demo": frozenset({*_LOWER, "dgxmm.config"}),  # what the demo does differently
    # The demo's LiteLLM process: the demo's plan for it, and the gateway's HTTP client.
    "dgxmm.demo_litellm": frozenset({*_LOWER, "dgxmm.config", "dgxmm.demo"}),
    "dgxmm.admin": frozenset(
        {*_LOWER, "dgxmm.config", "dgxmm.replay", "dgxmm.engines", "dgxmm.litellm"}
    ),
    "dgxmm.app": frozenset(
        {
            *_LOWER,
            "dgxmm.config",
            "dgxmm.replay",
            "dgxmm.engines",
            "dgxmm.litellm",
            "dgxmm.admin",
            "dgxmm.private",
            "dgxmm.demo",
            "dgxmm.demo_litellm",
        }
    ),
    "dgxmm.cli": frozenset(
        {
            *_LOWER,
            "dgxmm",
            "dgxmm.config",
            "dgxmm.replay",
            "dgxmm.engines",
            "dgxmm.litellm",
            "dgxmm.admin",
            "dgxmm.app",
            "dgxmm.private",
            "dgxmm.where",
            "dgxmm.tune_apply",
        }
    ),
    # `dgxmm tune --apply`: the tune command's recommendation, sent through the admin client.
    "dgxmm.tune_apply": frozenset({*_LOWER, "simulations", "dgxmm.replay", "dgxmm.admin"}),
    # Which DGXMM a command works on: the configuration, and the server's token file's name.
    "dgxmm.where": frozenset({"dgxmm.config", "dgxmm.admin"}),
    "dgxmm.__main__": frozenset({"dgxmm.cli"}),
}


def unit_of(module: str) -> str:
    """The unit a dotted module name belongs to (`dgxmm.admin.api` -> `dgxmm.admin`)."""
    parts = module.split(".")
    if parts[0] == "dgxmm" and len(parts) > 1:
        return f"dgxmm.{parts[1]}"
    return parts[0]


def module_name(path: Path, root: Path) -> str:
    """`dgxmm/admin/api.py` -> `dgxmm.admin.api`; a package's `__init__.py` names the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_statements(path: Path, module: str) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names taken from it) of every import statement in one file, relative ones
    resolved; `import a.b` takes no names."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            yield node.lineno, target, tuple(alias.name for alias in node.names)


def imports_of(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import of ours in one file, relative ones resolved."""
    for line, target, names in import_statements(path, module):
        yield line, target
        # `from dgxmm import admin` imports the room `dgxmm.admin`.
        for name in names:
            yield line, f"{target}.{name}"


def violations(root: Path) -> list[str]:
    """Every import in the tree that runs against the allowed direction, as readable lines."""
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            unit = unit_of(module)
            allowed = ALLOWED.get(unit)
            if allowed is None:
                found.append(f"{path.relative_to(root)}: unit {unit} has no rule in ALLOWED")
                continue
            for line, target in imports_of(path, module):
                top = target.split(".")[0]
                if top not in PACKAGES:
                    continue
                other = unit_of(target)
                if other == unit or other in allowed:
                    continue
                # `from dgxmm import admin` names the room; `from dgxmm.admin import api`
                # yields `dgxmm.admin` too, which is checked above.
                if target == "dgxmm" and unit.startswith("dgxmm"):
                    continue
                found.append(f"{path.relative_to(root)}:{line}: {unit} imports {target}")
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every product module and the product modules it imports.

    `from a import b` imports the module `a.b` when there is one, else the module `a` (a name
    defined there, or re-exported by a package's `__init__`); the parent packages Python runs
    first are not counted, or every package that re-exports its modules would be a cycle.
    """
    paths = {
        module_name(path, root): path
        for package in PACKAGES
        for path in sorted((root / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {module: set() for module in paths}
    for module, path in paths.items():
        for _, target, names in import_statements(path, module):
            found = {f"{target}.{n}" for n in names if f"{target}.{n}" in paths}
            if len(found) < len(names) or not names:
                found.add(target)
            graph[module] |= {t for t in found if t in paths and t != module}
    return graph


def _groups(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def _shortest_loop(graph: Mapping[str, set[str]], start: str, group: list[str]) -> list[str]:
    """The shortest path from `start` back to itself inside `group` (breadth first)."""
    members = set(group)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for other in sorted(graph[node] & members):
            if other == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if other not in came_from:
                came_from[other] = node
                queue.append(other)
    raise AssertionError(f"{start} is in no loop of {group}")  # a group always has one


def cycles(root: Path) -> list[str]:
    """Every group of product modules that import each other, as one readable loop each."""
    graph = import_graph(root)
    return [" -> ".join(_shortest_loop(graph, g[0], g)) for g in _groups(graph)]

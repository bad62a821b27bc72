"""The dependency direction, checked over the source tree: `events` <- `storage` <- `actors` <-
`gateway` <- `dgxmm`, and inside `dgxmm` the rooms (`admin`, `engines`, `litellm`) below what wires
and starts (`app`, `cli`).

Every import counts, at module level or inside a function, absolute or relative.  A planted
import that runs back up is caught (the last tests plant one in a copy of a small tree).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
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
        }
    ),
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


def imports_of(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import of ours in one file, relative ones resolved."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            yield node.lineno, target
            # `from dgxmm import admin` imports the room `dgxmm.admin`.
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"


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


def test_every_import_in_the_source_tree_points_down_the_layers() -> None:
    assert violations(ROOT) == []


def test_every_package_and_room_opens_with_a_docstring_saying_what_it_owns() -> None:
    inits = [ROOT / p / "__init__.py" for p in PACKAGES if p != "dgxmm"]
    inits += [ROOT / "dgxmm" / room / "__init__.py" for room in ("admin", "engines", "litellm")]
    missing = [
        str(p.relative_to(ROOT)) for p in inits if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert missing == []


def test_no_product_module_imports_the_tests() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for line, target in imports_of(path, module_name(path, ROOT))
        if target.split(".")[0] == "tests"
    ]
    assert offenders == []


def _small_tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text('"""x."""\n')
    (tmp_path / "dgxmm" / "engines").mkdir()
    (tmp_path / "dgxmm" / "engines" / "__init__.py").write_text('"""x."""\n')
    (tmp_path / "gateway" / "app.py").write_text("from actors import admission\n")
    return tmp_path


def test_the_checker_accepts_a_tree_whose_imports_point_down(tmp_path: Path) -> None:
    assert violations(_small_tree(tmp_path)) == []


def test_a_planted_import_from_the_actors_up_into_the_gateway_is_caught(tmp_path: Path) -> None:
    root = _small_tree(tmp_path)
    (root / "actors" / "queue.py").write_text("def f():\n    from gateway import app\n")
    assert violations(root) == [
        "actors/queue.py:2: actors imports gateway",
        "actors/queue.py:2: actors imports gateway.app",
    ]


def test_a_relative_import_from_an_engine_room_into_the_admin_room_is_caught(
    tmp_path: Path,
) -> None:
    root = _small_tree(tmp_path)
    (root / "dgxmm" / "engines" / "probe.py").write_text("from ..admin import auth\n")
    assert violations(root) == [
        "dgxmm/engines/probe.py:1: dgxmm.engines imports dgxmm.admin",
        "dgxmm/engines/probe.py:1: dgxmm.engines imports dgxmm.admin.auth",
    ]

"""The dependency direction, the import cycles and the module docstrings, checked over the tree.

The checker of imports is `tests/layers_support.py` (`scripts/import-cycles` runs its cycle
check in `make lint`).  A planted import that runs back up, a planted loop and a planted
docstring that names no trade are caught (the last tests plant them in a copy of a small tree).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.layers_support import PACKAGES, ROOT, cycles, imports_of, module_name, violations


def test_every_import_in_the_source_tree_points_down_the_layers() -> None:
    assert violations(ROOT) == []


def test_no_two_product_modules_import_each_other_even_round_a_loop() -> None:
    assert cycles(ROOT) == []


def docstring_problems(root: Path) -> list[str]:
    """Every product module whose docstring does not open with a one-line sentence."""
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            lines = (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines() or [""]
            first = lines[0].strip()
            if not first:
                found.append(f"{path.relative_to(root)}: no docstring")
            elif not first.endswith((".", ":")) or (len(lines) > 1 and lines[1].strip()):
                found.append(f"{path.relative_to(root)}: first line is no sentence: {first}")
    return found


def test_every_product_module_opens_with_a_one_line_sentence_that_names_its_trade() -> None:
    assert docstring_problems(ROOT) == []


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
    (tmp_path / "gateway" / "app.py").write_text('"""x."""\n\nfrom actors import admission\n')
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


def test_the_cycle_checker_accepts_a_tree_without_loops(tmp_path: Path) -> None:
    assert cycles(_small_tree(tmp_path)) == []


def test_a_planted_cycle_through_a_type_checking_import_is_caught(tmp_path: Path) -> None:
    root = _small_tree(tmp_path)
    (root / "gateway" / "app.py").write_text("from gateway.express import Exchange\n")
    (root / "gateway" / "express.py").write_text(
        "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from gateway.app import Gateway\n"
    )
    assert cycles(root) == ["gateway.app -> gateway.express -> gateway.app"]


def test_a_planted_loop_of_three_through_relative_and_function_level_imports_is_caught(
    tmp_path: Path,
) -> None:
    root = _small_tree(tmp_path)
    (root / "storage" / "a.py").write_text("from . import b\n")
    (root / "storage" / "b.py").write_text("def f():\n    from storage.c import x\n")
    (root / "storage" / "c.py").write_text("import storage.a\n\nx = 1\n")
    assert cycles(root) == ["storage.a -> storage.b -> storage.c -> storage.a"]


def test_a_package_that_re_exports_its_modules_is_no_cycle_with_them(tmp_path: Path) -> None:
    root = _small_tree(tmp_path)
    (root / "gateway" / "__init__.py").write_text('"""x."""\n\nfrom gateway.app import Gateway\n')
    (root / "gateway" / "app.py").write_text("from gateway import errors\n\nGateway = 1\n")
    (root / "gateway" / "errors.py").write_text("")
    assert cycles(root) == []
    # ... but a module that takes a name from the package itself does close a loop.
    (root / "gateway" / "errors.py").write_text("from gateway import Gateway\n")
    assert cycles(root) == ["gateway -> gateway.app -> gateway.errors -> gateway"]


def test_a_planted_module_without_a_docstring_or_with_a_run_on_first_line_is_caught(
    tmp_path: Path,
) -> None:
    root = _small_tree(tmp_path)
    assert docstring_problems(root) == []
    (root / "actors" / "queue.py").write_text("import os\n")
    run_on = '"""Moving old events out of the log\ninto a file."""\n'
    (root / "storage" / "archive.py").write_text(run_on)
    assert docstring_problems(root) == [
        "storage/archive.py: first line is no sentence: Moving old events out of the log",
        "actors/queue.py: no docstring",
    ]

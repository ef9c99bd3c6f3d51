"""The tree's layout: no folder of more than 30 modules, each test module's name once under tests/.

A folder past 30 modules is split by subject (tests/unit/<subject>/,
tests/integration/<subject>/, bench/fleet/, ...), so a reader finds a module by
what it is about. Every folder of tests/ is a package, so pytest imports a test
module by its dotted path and a module that imports another's fixtures gets
that same module; a test module's name is still used once across the tiers and
subject folders, so a `-k`, a log line or a --durations row names one file.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MOST_MODULES = 30
BUILT = {"__pycache__", "build", "dist"}  # what setuptools and Python write into a working tree


def _folders(top: Path) -> dict[str, list[Path]]:
    """The .py files of every folder under top, by path relative to ROOT (dot folders, caches, venvs and build output left out)."""
    found: dict[str, list[Path]] = {}
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in BUILT)
        modules = sorted(Path(folder, f) for f in files if f.endswith(".py"))
        if modules:
            found[Path(folder).relative_to(ROOT).as_posix()] = modules
    return found


def test_no_folder_holds_more_than_30_modules() -> None:
    sizes = {folder: len(files) for folder, files in _folders(ROOT).items()}
    assert {f: n for f, n in sizes.items() if n > MOST_MODULES} == {}


def test_no_test_module_name_is_used_twice_under_tests() -> None:
    names = Counter(p.name for files in _folders(ROOT / "tests").values() for p in files if p.name.startswith("test_"))
    assert {name: n for name, n in names.items() if n > 1} == {}


def test_every_folder_of_tests_is_a_package() -> None:
    folders = _folders(ROOT / "tests")
    assert [f for f, files in folders.items() if ROOT / f / "__init__.py" not in files] == []

"""The docs name the tests that show each behaviour and the files that implement it: a name that
no longer exists (a test renamed, a module moved) sends a reader to nothing, so they are held to
the tree here."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `test_x.py::test_name[id]`, `tests/test_x.py::test_name`, or `::test_name` naming a test of the
# file named last before it; a bare `test_x.py` names the file the next `::test_name` is in
TEST_REF = re.compile(r"`(?:(?:tests/)?(test_\w+\.py))?::(test_\w+)(?:\[[^\]`]*\])?`|`(?:tests/)?(test_\w+\.py)`")
FILE_REF = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|toml|conf|flac|md|sh))\b")


def _tests_of(path: Path) -> set[str]:
    return set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))


def test_every_test_the_docs_name_exists() -> None:
    tests = {path.name: _tests_of(path) for path in (ROOT / "tests").glob("test_*.py")}
    missing = []
    for doc in DOCS:
        current: str | None = None
        for m in TEST_REF.finditer(doc.read_text()):
            if m.group(3):
                current = m.group(3)
                continue
            current = m.group(1) or current
            if current not in tests or m.group(2) not in tests[current]:
                missing.append(f"{doc.name}: {current}::{m.group(2)}")
    assert not missing, missing


def test_every_file_the_docs_name_exists() -> None:
    missing = [f"{doc.name}: {m.group(1)}" for doc in DOCS for m in FILE_REF.finditer(doc.read_text())
               if not m.group(1).startswith("/") and not (ROOT / m.group(1)).exists()]
    assert not missing, missing

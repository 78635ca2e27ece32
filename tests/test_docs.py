"""The docs name the tests that show each behaviour and the files that implement it: a name that
no longer exists (a test renamed, a module moved) sends a reader to nothing, so they are held to
the tree here; and the README's client example is run as a reader would run it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile

from conftest import ROOT
from streamasr import testdata

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


def test_the_readme_s_client_example_transcribes_a_call(service, tmp_path: Path) -> None:
    """The README's client example, run as written (its address the test service's): a reader
    who copies it sees partials while the call goes on and a timestamped final of what was said."""
    [code] = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    [said] = [u for u in testdata.utterances() if u.name == "goforward"]
    soundfile.write(tmp_path / "call.wav", np.fromfile(said.path, "<i2"), 16000, subtype="PCM_16")
    done = subprocess.run([sys.executable, "-c", code.replace("tcp://127.0.0.1:7700", service.address)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("... ") and line[4:].strip() for line in lines), lines
    finals = [line for line in lines if re.match(r"\[\d+\.\d\d-\d+\.\d\d\] \S", line)]
    assert len(finals) == 1 and "forward" in finals[0].lower(), lines

"""The command line as a shell uses it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`streamasr status | head -1`: once the reader has closed the pipe, the command stops without a
    traceback on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "streamasr.cli", "status", "--instance", "nosuchinstance"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert stderr == ""

"""`transcribe --out-dir`: each file's transcript in a file of its own, named after it.

A folder of recordings is captioned in one run, its files streamed at once, instead of one run a
file to keep their outputs apart. A transcript is written beside its final name and put in place
whole once its file is transcribed, so a reader never takes a part for the whole, and a file that
failed leaves none (what went wrong is said on stderr, as without the flag). A transcript, or
standard output, that cannot be written (a full disk) is said here, for both ways of transcribing.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import TextIO


def suffix(as_json: bool, subtitles: str | None, rows: bool) -> str:
    """The transcript's file suffix: its cues' format, JSON lines (one row per event, `rows`) or
    one JSON object, or text."""
    if subtitles:
        return f".{subtitles}"
    if as_json:
        return ".jsonl" if rows else ".json"
    return ".txt"


def prepare(files: list[str], out_dir: Path) -> str | None:
    """Make `out_dir` if it is missing; why `files` cannot each have a transcript there, if they
    cannot: said before anything streams, rather than once the first file is transcribed."""
    seen: dict[str, str] = {}
    for file in files:
        name = Path(file).stem
        if seen.get(name) == file:
            return f"--out-dir: {file} is named twice"
        if name in seen:
            return f"--out-dir: {seen[name]} and {file} would both be written as {name}"
        seen[name] = file
    if out_dir.exists() and not out_dir.is_dir():
        return f"--out-dir {out_dir}: not a directory"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--out-dir {out_dir}: cannot make it: {exc.strerror}"
    if not os.access(out_dir, os.W_OK | os.X_OK):
        return f"--out-dir {out_dir}: not writable"
    _clear_leftovers(out_dir)
    return None


def _clear_leftovers(out_dir: Path) -> None:
    """Remove the hidden files that runs on this host killed outright (SIGKILL, the OOM killer) left
    half written: their process is gone. Another host's (a shared folder) are not ours to judge."""
    host = socket.gethostname()
    for path in out_dir.glob(".*.partial"):
        head, _, pid = path.name.removesuffix(".partial").rpartition(".")
        if head.endswith(f".{host}") and pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 and below name process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def unwritable(where: str, exc: OSError, file: str | None = None) -> None:
    """Say that `where` (`file`'s transcript) could not be written (a full disk, a file over its
    size limit), unless its reader went away (standard output piped to `head`), which asks for
    no more and is no fault."""
    if not isinstance(exc, BrokenPipeError):
        print(f"{file + ': ' if file else ''}cannot write {where}: {exc.strerror or exc}", file=sys.stderr)


def stdout_unwritable(out: TextIO, exc: OSError) -> None:
    """Say that the run's output could not be written, as `unwritable` does; when that output is
    standard output, point it at /dev/null so that the interpreter's own flush at exit does not
    fail again with a traceback of its own."""
    unwritable("standard output", exc)
    if out is sys.stdout:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class Transcript:
    """One file's transcript on its way into `out_dir`: written to a hidden file beside its final
    name, then put in place whole (`keep`) or removed (`drop`). Each write opens that file and
    closes it again, so a run of thousands of files holds none open while they wait their turn,
    or once they are done while the others are."""

    def __init__(self, out_dir: Path, file: str, suffix: str, header: str = "") -> None:
        self.path = out_dir / (Path(file).stem + suffix)
        # host and process in its name: the names of one run's files differ, and a run killed outright is known by it
        self._partial = out_dir / f".{self.path.name}.{socket.gethostname()}.{os.getpid()}.partial"
        self._header = header  # what the file begins with (WebVTT's), written with its first text
        self._begun = False

    def write(self, text: str) -> int:
        """Add `text`, flushed and closed; OSError (a full disk) if it cannot be."""
        with open(self._partial, "a" if self._begun else "w", encoding="utf-8") as out:
            out.write(text if self._begun else self._header + text)
        self._begun = True
        return len(text)

    def flush(self) -> None:
        """Each write is on disk already."""

    def isatty(self) -> bool:
        return False

    def keep(self) -> None:
        """Put the transcript in place (its header alone when nothing was written); OSError (a
        full disk) if it cannot be, and then `drop` it."""
        if not self._begun:
            self.write("")
        os.replace(self._partial, self.path)

    def drop(self) -> None:
        self._partial.unlink(missing_ok=True)

"""`transcribe --out-dir`: each file's transcript in a file of its own, named after it.

A folder of recordings is captioned in one run, its files streamed at once, instead of one run a
file to keep their outputs apart. A transcript is written beside its final name and put in place
whole once its file is transcribed, so a reader never takes a part for the whole, and a file that
failed leaves none (what went wrong is said on stderr, as without the flag).
"""

from __future__ import annotations

import os
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
        if name in seen and seen[name] != file:
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
    return None


class Transcript:
    """One file's transcript on its way into `out_dir`: written to a hidden file beside its final
    name, then put in place whole (`keep`) or removed (`drop`)."""

    def __init__(self, out_dir: Path, file: str, suffix: str) -> None:
        self.path = out_dir / (Path(file).stem + suffix)
        self._partial = out_dir / f".{self.path.name}.{os.getpid()}.partial"  # the names of one run's files differ
        self.out: TextIO = open(self._partial, "w", encoding="utf-8")

    def keep(self) -> None:
        self.out.close()
        os.replace(self._partial, self.path)

    def drop(self) -> None:
        self.out.close()
        os.unlink(self._partial)

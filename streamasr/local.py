"""`streamasr transcribe --local`: transcribe files in this process, no service needed."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from config.settings import ModelConfig
from streamasr.outdir import Transcript, stdout_unwritable, suffix, unwritable
from streamasr.subtitles import Writer

if TYPE_CHECKING:
    from speech.backend import DecodeResult


def run(
    files: list[str],
    model: ModelConfig,
    language: str | None = None,
    as_json: bool = False,
    threads: int = 1,
    out: TextIO = sys.stdout,
    subtitles: str | None = None,
    prompt: str | None = None,
    out_dir: Path | None = None,
) -> int:
    """Print each file's transcript (plain text, one JSON object per line, or `subtitles` cues,
    "srt" or "vtt"); 0 if all succeeded. `model`: the config's `[model]`, decoded on its
    `precision`'s graphs alone; `prompt`: Whisper's initial prompt for each file; with `out_dir`
    each file's output goes to a file of its own there."""
    from speech import longform
    from speech.audio import AudioError, load_audio
    from speech.backend import SAMPLE_RATE
    from speech.loader import ModelError, language_refusal, load_backend, served_languages

    cfg = replace(model, partial_precision="", threads=threads)
    try:
        # refused before the model is loaded (and exported, on a first run), as the ingest refuses an open
        if why := language_refusal(cfg.name, served_languages(cfg), language):
            print(f"error: {why}", file=sys.stderr)
            return 2
        backend = load_backend(cfg)
    except (ModelError, ValueError, NotImplementedError) as exc:
        print(f"error: cannot load model {cfg.name}: {exc}", file=sys.stderr)
        return 2
    status = 0
    try:
        for path in files:
            try:
                audio = load_audio(path)
                result = longform.transcribe(backend, audio, language=language or None, prompt=prompt)
            except AudioError as exc:
                print(f"error: {exc}", file=sys.stderr)
                status = 1
                continue
            except Exception as exc:  # one bad file must not stop the others
                print(f"error: {path}: transcription failed: {exc!r}", file=sys.stderr)
                status = 1
                continue
            if subtitles:
                writer = Writer(subtitles)
                written = writer.header() + "".join(writer.final(s.start, s.end, s.text, None, words)
                                                    for s, words in zip(result.segments, _by_segment(result)))
            elif as_json:
                obj = {
                    "file": path,
                    "text": result.text,
                    "language": result.language,
                    "segments": [{"start": s.start, "end": s.end, "text": s.text} for s in result.segments],
                    "words": [{"start": w.start, "end": w.end, "word": w.text} for w in result.words],
                    "duration": round(len(audio) / SAMPLE_RATE, 3),
                }
                written = json.dumps(obj, ensure_ascii=False) + "\n"
            else:
                prefix = f"{path}: " if len(files) > 1 and out_dir is None else ""
                written = prefix + result.text + "\n"
            if out_dir is None:
                try:
                    out.write(written)
                    out.flush()
                except OSError as exc:  # nothing more can be given: the files left are not transcribed
                    stdout_unwritable(out, exc)
                    return 1
                continue
            transcript = Transcript(out_dir, path, suffix(as_json, subtitles, rows=False))
            try:
                transcript.write(written)
                transcript.keep()
            except OSError as exc:  # this file's alone: the next may be smaller, or the disk freed
                transcript.drop()
                unwritable(str(transcript.path), exc, path)
                status = 1
    finally:
        backend.close()
    return status


def _by_segment(result: DecodeResult) -> list[list[list[Any]]]:
    """The result's timed words as rows, in runs of its segments' words (a segment's cues are
    timed by them where they hold its text)."""
    runs: list[list[list[Any]]] = []
    words = iter(result.words)
    for segment in result.segments:
        run: list[list[Any]] = []
        letters = 0  # a segment's words are as many letters as its text, spaces aside
        while letters < len("".join(segment.text.split())) and (word := next(words, None)) is not None:
            run.append([word.start, word.end, word.text])
            letters += len("".join(word.text.split()))
        runs.append(run)
    return runs

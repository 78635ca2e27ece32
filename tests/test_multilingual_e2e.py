"""Streams in languages other than English through the running service, on the multilingual
Whisper base: `streamasr serve`, then `streamasr transcribe --server --realtime --json`, as a
user runs them, on espeak-ng speech (German; Japanese written in kana, which espeak-ng reads:
its kanji it spells out as "Chinese letter").
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import soundfile as sf

from client import Client
from conftest import Service, running
from protocol.messages import Closed, ErrorMsg, Final, Partial
from streamasr import service as svc
from streamasr.testdata import spoken
from streaming import send_paced

pytestmark = pytest.mark.base

GERMAN = ["Guten Morgen, wie geht es Ihnen heute? Ich gehe in die Stadt und kaufe Brot.",
          "Am Abend fahren wir mit dem Zug nach Berlin und besuchen meine Eltern."]
SPANISH = ["Buenos días, ¿cómo estás? Hoy vamos a la playa con mis amigos.",
           "Mañana compramos pan y leche en el mercado de la ciudad."]
JAPANESE = "きょうは いい てんき ですね。 こうえんに さんぽに いきましょう。"
KANA = re.compile("[\u3040-\u30ff]")
CJK = re.compile("[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")
# what German is written with; a partial in another language (Whisper's detection on a second of
# German hears English, Vietnamese, Thai) brings letters of its own
GERMAN_TEXT = re.compile(r"[A-Za-zÄÖÜäöüß0-9\s.,;:?!'\"()\-]*")
SPANISH_TEXT = re.compile(r"[A-Za-zÁÉÍÓÚÜÑáéíóúüñ0-9\s.,;:¿?¡!'\"()\-]*")


@pytest.fixture(scope="module")
def base_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """whisper-base on one worker, which a stream of it keeps busy: the streams here, one at a
    time, are admitted whatever the last one left in the admission figures."""
    with running(tmp_path_factory.mktemp("base"), model="whisper-base", workers=1,
                 ingest={"admit_max_busy": 0, "admit_max_load_s": 0}) as svc:
        yield svc


def _utterances(tmp: Path, voice: str, texts: list[str], gap_s: float = 1.0) -> Path:
    """The texts spoken one after another, each followed by `gap_s` of silence (a pause ends a segment)."""
    parts: list[np.ndarray] = []
    rate = 0
    for i, text in enumerate(texts):
        pcm, rate = sf.read(str(spoken(text, tmp / f"{voice}{i}.wav", voice)), dtype="int16")
        parts += [pcm, np.zeros(int(gap_s * rate), np.int16)]
    path = tmp / f"{voice}.wav"
    sf.write(str(path), np.concatenate(parts), rate, subtype="PCM_16")
    return path


def _transcribe(service: Service, path: Path, *options: str) -> list[dict[str, Any]]:
    """What `transcribe --server --realtime --json` shows: partials, finals and the summary."""
    done = service.cli("transcribe", "--server", service.address, "--realtime", "--json", *options, str(path), timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _rows(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["type"] == kind]


def test_partials_after_a_final_are_in_the_language_it_heard(base_service: Service, tmp_path: Path) -> None:
    """Opened without a language, the partials of a segment after the first final are in the
    language that final was heard in, not each in the one its second of audio sounds like. The
    pauses are long enough for each final to come back before the next segment starts: a segment's
    partials sent before the final of the one before it is back detect their own language."""
    rows = _transcribe(base_service, _utterances(tmp_path, "de", GERMAN + GERMAN[:1], gap_s=3.0))
    finals = _rows(rows, "final")
    assert len(finals) == 3, finals
    for final, words in zip(finals, (("morgen", "stadt"), ("abend", "berlin"), ("morgen", "stadt"))):
        assert all(w in final["text"].casefold() for w in words), final
        assert final["start"] < final["end"]
    assert [f["start"] for f in finals] == sorted(f["start"] for f in finals)
    assert [f["language"] for f in finals] == ["de"] * 3  # detected on each whole segment, and said
    later = [p for p in _rows(rows, "partial") if p["seg"] > 0 and p["text"]]
    assert later, "no partial after the first final"
    assert [p["text"] for p in later if not GERMAN_TEXT.fullmatch(p["text"])] == []
    assert {p["language"] for p in later} == {"de"}


def test_japanese_partials_settle_character_by_character(base_service: Service, tmp_path: Path) -> None:
    """Japanese, written without spaces: `stable` grows a character at a time (a sentence is not
    one word never settled before the final), and the transcript puts no space between segments."""
    rows = _transcribe(base_service, _utterances(tmp_path, "ja", [JAPANESE, JAPANESE]), "--language", "ja")
    finals = _rows(rows, "final")
    assert len(finals) == 2 and all(KANA.search(f["text"]) for f in finals), finals
    partials = _rows(rows, "partial")
    assert any(KANA.search(p["stable"]) for p in partials), partials  # partials may thin out under load: in some segment
    for seg in (0, 1):  # what a partial marked stable, later partials of its segment keep
        stables = [p["stable"] for p in partials if p["seg"] == seg]
        assert all(later.startswith(earlier) for earlier, later in zip(stables, stables[1:])), stables
    texts = [f["text"] for f in finals]
    assert all(CJK.fullmatch(t[0]) and CJK.fullmatch(t[-1]) for t in texts), texts
    assert {r["language"] for r in finals + partials} == {"ja"}  # the language given is each one's
    [summary] = _rows(rows, "summary")
    assert summary["text"] == "".join(texts)


@pytest.mark.parametrize("language", ["es", None], ids=["given", "detected"])
def test_a_resumed_stream_keeps_its_language(base_service: Service, tmp_path: Path, language: str | None) -> None:
    """A Spanish stream whose ingest is killed after its first final resumes on the restarted
    ingest: what comes after is Spanish. Opened in Spanish, the client re-opens it as it was
    opened, `language` too. Opened without a language, the client sends the language its last
    final was heard in (`resume_language`), and the new ingest decodes the partials in it until
    a final of its own has words, rather than each detecting its language on a second of audio.
    The pauses are long enough for the resume to be done before the next sentence starts: its
    first partials are decoded on a second of speech, which detection here hears as Italian or
    Welsh."""
    pcm, rate = sf.read(str(_utterances(tmp_path, "es", SPANISH + SPANISH[:1], gap_s=3.0)), dtype="int16")
    ingest = next(int(p["pid"]) for p in svc.processes(base_service.cfg) if p["name"] == "ingest-0")
    client = Client(base_service.address, liveness=5.0)
    stream = client.open(rate=rate, language=language)
    sender = threading.Thread(target=send_paced, args=(stream, pcm, rate, rate // 10), daemon=True)
    sender.start()
    finals: list[Final] = []
    partials: list[Partial] = []
    try:
        for ev in stream.events(timeout=60):
            if isinstance(ev, Final):
                if not finals:
                    os.kill(ingest, signal.SIGKILL)
                finals.append(ev)
            elif isinstance(ev, Partial):
                partials.append(ev)
            elif isinstance(ev, ErrorMsg):
                pytest.fail(f"error: {ev}")
            elif isinstance(ev, Closed):
                assert ev.reason == "end", ev
    finally:
        sender.join(30)
        client.close()
    assert client.reconnects >= 1 and stream.resumes, "the stream never resumed"
    texts = [f.text.casefold() for f in finals if f.text.strip()]
    assert len(texts) == 3, texts
    for text, words in zip(texts, (("playa", "amigos"), ("compramos", "mercado"), ("playa", "amigos"))):
        assert all(w in text for w in words), texts
    assert [f.language for f in finals] == ["es"] * len(finals)
    after = [p for p in partials if p.start >= finals[0].end and p.text]
    assert after, "no partial after the resume"
    assert [p.text for p in after if not SPANISH_TEXT.fullmatch(p.text)] == []
    assert [p.language for p in after] == ["es"] * len(after)
    resumed = [e for e in base_service.events("ingest-0") if e["event"] == "ingest.stream_opened" and e["stream"] == stream.id
               and e["offset"] > 0]
    assert resumed and {e["resume_language"] for e in resumed} == {None if language else "es"}, resumed  # what the client sent

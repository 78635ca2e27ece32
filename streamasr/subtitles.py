"""Subtitles from finals: SubRip (.srt) and WebVTT (.vtt) cues, as captions are read.

A final is a segment between pauses and may run 25 s; a cue must be read while it shows. So a
final is cut into cues of at most two lines of MAX_LINE characters and MAX_CUE_S seconds, at word
boundaries (text without spaces, as Chinese and Japanese are written, at characters, in lines of
MAX_LINE_UNSPACED). A final's `parts` (Whisper's own segments of it, timed by the model) are
joined into cues while they fit one, so a cue starts and ends where the model heard its phrases
(a part too short to read alone joins the one before); within a part, a cue starts where its
first word was heard, by the final's `words` (timed by the model), or without them by its share
of the characters, an estimate; the final's own start and end are kept exactly. Words PAUSE_S
or more apart are not shown in one cue, and a cue before such a pause leaves the screen HOLD_S
after its last word. A call with each party on its own channel, each a stream, gives one
track of both parties' cues in the order they start, each said to be its speaker's, written as
they speak.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any

MAX_LINE = 42  # characters a caption line holds (broadcast captioning's usual limit)
MAX_LINE_UNSPACED = 16  # for text written without spaces: Chinese and Japanese characters are wide
MAX_LINES = 2
MAX_CUE_S = 7.0
MIN_PART_S = 1.5  # a part shorter than this ("he was.") is read with the one before, not as a cue of its own
PAUSE_S = 1.0  # words this far apart are not shown in one cue
HOLD_S = 1.0  # a cue timed by its words shows at most this long past its last word when a pause follows
TIME_SLACK = 0.001  # parts' times are rounded to the millisecond, the final's are not
CLOSING = "，。、！？；：」』）》,.!?;:)"  # kept with the character before them in text without spaces


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    lines: tuple[str, ...]


def _units(text: str) -> tuple[list[str], str]:
    """The pieces a cue may be cut between, and what joins them: words, or characters in text
    written without spaces."""
    words = text.split()
    if len(words) == 1 and len(words[0]) > MAX_LINE_UNSPACED:
        units: list[str] = []
        for char in words[0]:  # a line does not begin with a comma or a full stop
            if units and char in CLOSING:
                units[-1] += char
            else:
                units.append(char)
        return units, ""
    return words, " "


def _width(sep: str) -> int:
    return MAX_LINE if sep else MAX_LINE_UNSPACED


def _balanced(units: list[str], sep: str, parts: int) -> list[list[str]]:
    """`units` in `parts` runs of about equal length, in order, none empty."""
    total = len(sep.join(units))
    runs: list[list[str]] = [[]]
    done = 0
    for i, unit in enumerate(units):
        # a new run where this one comes nearest its share, while units remain for the runs still to come
        if (runs[-1] and len(runs) < parts and done + (len(unit) + len(sep)) / 2 >= total * len(runs) / parts
                and len(units) - i >= parts - len(runs)):
            runs.append([])
        runs[-1].append(unit)
        done += len(unit) + len(sep)
    return runs


def _lines(units: list[str], sep: str) -> tuple[str, ...]:
    text = sep.join(units)
    if len(text) <= _width(sep) or len(units) < 2:
        return (text,)
    return tuple(sep.join(run) for run in _balanced(units, sep, MAX_LINES))


def cues(start: float, end: float, text: str, times: list[tuple[float, float]] | None = None) -> list[Cue]:
    """One final's cues: as few as hold its text in two lines each and show none longer than
    MAX_CUE_S. `times`: when each of the text's words was heard (text with spaces only)."""
    units, sep = _units(text.strip())
    if not units:
        return []
    if times is not None and (not sep or len(times) != len(units)):
        times = None
    if times is not None and (pauses := [i for i in range(1, len(units)) if times[i][0] - times[i - 1][1] >= PAUSE_S]):
        # a cue does not show across a pause: the words on each side are cued apart
        edges = [0, *pauses, len(units)]
        return [cue for a, b in zip(edges, edges[1:])
                for cue in cues(start if a == 0 else times[a][0],
                                end if b == len(units) else min(times[b][0], times[b - 1][1] + HOLD_S),
                                sep.join(units[a:b]), times[a:b])]
    length = len(sep.join(units))
    count = min(len(units), max(math.ceil(length / (_width(sep) * MAX_LINES - 6)), math.ceil((end - start) / MAX_CUE_S), 1))
    while True:  # balanced by characters, a run of long words can still overflow its lines or its time
        out = _timed(start, end, length, sep, _balanced(units, sep, count), times)
        if count >= len(units) or all(c.end - c.start <= MAX_CUE_S and max(map(len, c.lines)) <= _width(sep) for c in out):
            return out
        count += 1


def word_times(start: float, end: float, text: str, words: list[list[Any]] | None) -> list[tuple[float, float]] | None:
    """When each word of `text` (split at spaces) was heard, from a final's timed `words`
    ([start, end, word] rows, the space before each word in it; a word of the text may be several
    of them, "ill" and "-disposed"): from its first's start to its last's end. None unless they
    hold the text word for word, in order, each starting within the final's span (its end may
    pass the span's, which was timed apart from the words)."""
    try:
        rows = [(float(w[0]), float(w[1]), w[2]) for w in words or ()]
        heard = "".join(w for _, _, w in rows).split()
    except (TypeError, ValueError, LookupError):  # not [start, end, word] rows: a service of another build
        return None
    if not rows or heard != text.split() or not all(start - TIME_SLACK <= a <= min(b, end + TIME_SLACK) for a, b, _ in rows):
        return None
    if any(b > a + TIME_SLACK for (_, b, _), (a, _, _) in zip(rows, rows[1:])):
        return None
    owner = [k for k, (_, _, w) in enumerate(rows) for c in w if not c.isspace()]  # each letter's row
    times, at = [], 0
    for unit in heard:
        times.append((rows[owner[at]][0], rows[owner[at + len(unit) - 1]][1]))
        at += len(unit)
    return times


def phrased(start: float, end: float, text: str, parts: list[list[Any]] | None,
            words: list[list[Any]] | None = None) -> list[Cue]:
    """A final's cues from its parts: adjacent parts joined while together they make one cue (a
    part under MIN_PART_S always), each group cut and timed as `cues` does within its own span,
    by the final's timed `words` where they hold its text. Without parts, or with parts that do
    not hold the final's text word for word, the final's cues as `cues` gives them."""
    heard = word_times(start, end, text, words)
    try:
        texts = [p[2].strip() for p in parts or ()]
        times = [(float(p[0]), float(p[1])) for p in parts or ()]
    except (TypeError, ValueError, LookupError, AttributeError):  # not [start, end, text] rows: a service of another build
        return cues(start, end, text, heard)
    if not all(start - TIME_SLACK <= a < b <= end + TIME_SLACK for a, b in times) or any(
            b > a for (_, b), (a, _) in zip(times, times[1:])):
        return cues(start, end, text, heard)  # parts that do not each take a span of their own, in order
    if " ".join(texts).split() == text.split():
        sep = " "
    elif "".join(texts) == "".join(text.split()):
        sep = ""  # text written without spaces
    else:
        return cues(start, end, text, heard)
    groups: list[tuple[float, float, str]] = []
    for (p_start, p_end), p_text in zip(times, texts):
        if groups and (p_end - p_start < MIN_PART_S or len(cues(groups[-1][0], p_end, groups[-1][2] + sep + p_text)) == 1):
            groups[-1] = (groups[-1][0], p_end, groups[-1][2] + sep + p_text)
        else:
            groups.append((p_start, p_end, p_text))
    out: list[Cue] = []
    done = 0  # the final's words the groups before took
    for g_start, g_end, g_text in groups:
        n = len(g_text.split())
        out += cues(g_start, g_end, g_text, heard[done : done + n] if heard and sep else None)
        done += n
    return out


def _timed(start: float, end: float, length: int, sep: str, runs: list[list[str]],
           times: list[tuple[float, float]] | None = None) -> list[Cue]:
    """Each run a cue, from `start` to `end`, each after the first starting when its first word was
    heard (`times`, one per unit), or by its share of the characters. A cue shows until the next
    one starts, or with word times, at most HOLD_S past its last word: a pause shows no cue."""
    bounds = [start]
    done = chars = 0
    for run in runs[:-1]:
        done += len(run)
        chars = min(chars + len(sep.join(run)) + len(sep), length)
        at = times[done][0] if times else start + (end - start) * chars / length
        bounds.append(min(max(at, bounds[-1]), end))
    bounds.append(end)
    out = [Cue(a, b, _lines(run, sep)) for a, b, run in zip(bounds, bounds[1:], runs)]
    if times:
        last = itertools.accumulate(len(run) for run in runs)
        out[:-1] = [Cue(c.start, min(c.end, max(c.start, times[n - 1][1] + HOLD_S)), c.lines) for c, n in zip(out[:-1], last)]
    return out


def _time(seconds: float, decimal: str) -> str:
    ms = max(round(seconds * 1000), 0)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{decimal}{ms % 1000:03d}"


def srt(cue: Cue, number: int, voice: str | None = None) -> str:
    """A SubRip cue; `voice` (who speaks it) in brackets before its text, as SubRip has no tag for it."""
    text = "\n".join(cue.lines) if voice is None else f"[{voice}] " + "\n".join(cue.lines)
    return f"{number}\n{_time(cue.start, ',')} --> {_time(cue.end, ',')}\n{text}\n\n"


def _vtt_escaped(text: str) -> str:
    """Text as WebVTT takes it in a cue or a voice's name: & and < start its markup, ">" ends a
    voice span, and "-->" may not appear in a cue at all."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def vtt(cue: Cue, voice: str | None = None) -> str:
    """A WebVTT cue; `voice` in WebVTT's voice span, which players show or style as the speaker."""
    text = _vtt_escaped("\n".join(cue.lines))
    if voice is not None:
        text = f"<v {_vtt_escaped(voice)}>{text}"
    return f"{_time(cue.start, '.')} --> {_time(cue.end, '.')}\n{text}\n\n"


VTT_HEADER = "WEBVTT\n\n"


@dataclass(frozen=True)
class Voiced:
    """A final and who said it."""

    voice: str
    start: float
    end: float
    text: str
    parts: list[list[Any]] | None = None
    words: list[list[Any]] | None = None


class Writer:
    """Cues in one format, numbered across the finals given one after another."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.number = 0

    def header(self) -> str:
        return VTT_HEADER if self.fmt == "vtt" else ""

    def final(self, start: float, end: float, text: str, parts: list[list[Any]] | None = None,
              words: list[list[Any]] | None = None) -> str:
        return self.write([(cue, None) for cue in phrased(start, end, text, parts, words)])

    def write(self, voiced: list[tuple[Cue, str | None]]) -> str:
        """Cues in this format, each with who speaks it, if anyone."""
        out = []
        for cue, voice in voiced:
            self.number += 1
            out.append(srt(cue, self.number, voice) if self.fmt == "srt" else vtt(cue, voice))
        return "".join(out)


class Conversation:
    """Several speakers' finals, each speaker a stream of its own, as one track written while they
    speak. WebVTT's cues are in the order they start, and one speaker's final can come after
    another's that started later, so a cue is held until no other speaker can still have a final
    that starts before it: `heard` says, for each, where its next final starts at the soonest (the
    stream's `durable`, once what came before it is said; never, once it ended)."""

    def __init__(self, writer: Writer, speakers: list[int]) -> None:  # by channel
        self._writer = writer
        self._until = dict.fromkeys(speakers, 0.0)
        self._held: list[tuple[float, int, int, Cue, str]] = []  # a heap: the soonest cue first
        self._order = itertools.count()  # a speaker's cues with one start keep their order

    def said(self, speaker: int, final: Voiced) -> str:
        """The cues that can be written now that `speaker` said `final`."""
        for cue in phrased(final.start, final.end, final.text, final.parts, final.words):
            heapq.heappush(self._held, (cue.start, next(self._order), speaker, cue, final.voice))
        return self._release()

    def heard(self, speaker: int, until: float) -> str:
        """The cues that can be written now that `speaker` will have no final starting before `until`
        (math.inf: none at all)."""
        self._until[speaker] = max(self._until[speaker], until)
        return self._release()

    def _release(self) -> str:
        ready = []
        while self._held:
            start, _, speaker, cue, voice = self._held[0]
            if any(start > until for other, until in self._until.items() if other != speaker):
                break
            heapq.heappop(self._held)
            ready.append((cue, voice))
        return self._writer.write(ready)

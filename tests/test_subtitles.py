"""Subtitles from finals: cues a viewer can read, in files players take."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from streamasr import testdata
from streamasr.subtitles import MAX_CUE_S, MAX_LINE, MAX_LINE_UNSPACED, Conversation, Voiced, Writer, cues, phrased

LONG = ("He was not an ill-disposed young man, unless to be rather cold-hearted and rather selfish is to be "
        "ill-disposed: but he was, in general, well respected; for he conducted himself with propriety in the "
        "discharge of his ordinary duties.")
UNSPACED = "我们今天去公园散步，天气非常好，阳光明媚，鸟儿在树上唱歌，孩子们在草地上玩耍，大人们在长椅上聊天。"


def test_a_short_final_is_one_cue_with_its_own_times() -> None:
    assert Writer("srt").final(0.11, 2.67, "Go forward 10 meters.") == "1\n00:00:00,110 --> 00:00:02,670\nGo forward 10 meters.\n\n"
    writer = Writer("vtt")
    assert writer.header() + writer.final(3725.5, 3727.25, "Ten of clubs.") == (
        "WEBVTT\n\n01:02:05.500 --> 01:02:07.250\nTen of clubs.\n\n")


@pytest.mark.parametrize("text, width, seconds", [(LONG, MAX_LINE, 21.5), (UNSPACED, MAX_LINE_UNSPACED, 12.0)])
def test_a_long_final_is_cut_into_cues_a_viewer_can_read(text: str, width: int, seconds: float) -> None:
    """Two lines each, none too long to read in the time it shows, one after another from the
    final's start to its end, and every word kept in order; text without spaces is cut at its
    characters, and a line does not begin with its punctuation."""
    got = cues(3.0, 3.0 + seconds, text)
    assert len(got) > 1
    assert got[0].start == 3.0 and got[-1].end == pytest.approx(3.0 + seconds)
    assert all(a.end == b.start for a, b in zip(got, got[1:]))
    assert all(1 <= len(c.lines) <= 2 and all(0 < len(line) <= width for line in c.lines) for c in got), got
    assert all(0 < c.end - c.start <= MAX_CUE_S for c in got), got
    joined = (" " if width == MAX_LINE else "").join(line for c in got for line in c.lines)
    assert joined == text
    assert not any(line[0] in "，。" for c in got for line in c.lines), got


def test_a_final_s_parts_time_its_cues_where_the_model_heard_them() -> None:
    """A final's parts (Whisper's own segments) start and end its cues: short ones joined while
    they fit one cue, a long one cut by its characters within its own span, the silence between
    them shown as no cue, a fragment too short to read alone shown with the part before it. Parts that do not hold the final's words, or overlap, are not trusted:
    the final is cut by its characters as before."""
    text = "Go forward. Ten meters. " + LONG
    parts = [[3.4, 4.1, "Go forward."], [4.1, 5.0, "Ten meters."], [6.2, 27.5, LONG]]
    got = phrased(3.0, 28.0, text, parts)
    assert got[0].start == 3.4 and got[0].lines == ("Go forward. Ten meters.",) and got[0].end == 5.0, got
    assert got[1].start == 6.2 and got[-1].end == 27.5 and len(got) > 3, got
    assert [line for c in got for line in c.lines] == [line for c in [got[0], *cues(6.2, 27.5, LONG)] for line in c.lines]
    fragment = phrased(3.0, 28.0, text + " Then stop.", [*parts, [27.5, 28.0, "Then stop."]])
    assert fragment[0] == got[0] and fragment[1].start == 6.2 and fragment[-1].end == 28.0, fragment
    assert fragment[-1].lines[-1].endswith("his ordinary duties. Then stop."), fragment  # not a cue of its own
    assert phrased(3.0, 28.0, text, None) == cues(3.0, 28.0, text)
    assert phrased(3.0, 28.0, text, [{"a": 1}]) == phrased(3.0, 28.0, text, [[3.4, "x"]]) == cues(3.0, 28.0, text)  # not rows
    assert phrased(3.0, 28.0, text, parts[:2]) == cues(3.0, 28.0, text)  # words left out
    assert phrased(3.0, 28.0, text, [parts[0], [3.9, 5.0, "Ten meters."], parts[2]]) == cues(3.0, 28.0, text)  # overlap
    unspaced = [[1.0, 4.0, UNSPACED[:16]], [4.0, 9.5, UNSPACED[16:]]]
    got = phrased(0.5, 10.0, UNSPACED, unspaced)
    assert got[0].start == 1.0 and got[-1].end == 9.5 and "".join(line for c in got for line in c.lines) == UNSPACED, got
    assert Writer("srt").final(3.0, 28.0, text, parts).startswith("1\n00:00:03,400 --> 00:00:05,000\nGo forward. Ten meters.\n\n2\n00:00:06,200")


def test_a_final_s_words_time_its_cues_where_they_were_heard() -> None:
    """A long final whose words were timed (the model's alignment): each cue after the first starts
    when its first word was heard, not at its share of the characters, and a cue before a pause
    leaves the screen a second after its last word: here the speaker says the first half fast,
    pauses, then says the rest. Words that do not hold the final's text, or run backwards, are
    not trusted: the characters' shares time the cues, as without words."""
    words = LONG.split()
    half = len(words) // 2
    # the first half in the first 3 s, then a pause, then the rest from 12 s to 21 s
    times = [3.0 + 3.0 * i / half for i in range(half)] + [12.0 + 9.0 * i / (len(words) - half) for i in range(len(words) - half)]
    timed = [[t, t + 0.1, " " + w] for t, w in zip(times, words)]
    got = phrased(3.0, 21.5, LONG, None, timed)
    by_share = cues(3.0, 21.5, LONG)
    assert " ".join(line for c in got for line in c.lines) == LONG and len(got) > 2
    assert got[0].start == 3.0 and got[-1].end == 21.5 and all(0 < c.end - c.start <= MAX_CUE_S for c in got), got
    at = -1
    for cue, after in zip(got, got[1:]):
        first, last = words.index(after.lines[0].split()[0], at + 1), words.index(cue.lines[-1].split()[-1], at + 1)
        assert after.start == times[first], (after, times[first])
        assert cue.end == min(after.start, times[last] + 0.1 + 1.0), (cue, times[last])
        at = last
    assert any(a.end < b.start for a, b in zip(got, got[1:]))  # the pause shows no cue
    assert phrased(3.0, 28.0, LONG, [[3.0, 21.5, LONG]], timed) == got  # within a part as well
    assert phrased(3.0, 21.5, LONG, None, timed[:-1]) == by_share  # a word left out
    assert phrased(3.0, 21.5, LONG, None, [timed[1], timed[0], *timed[2:]]) == by_share  # out of order
    assert phrased(3.0, 21.5, LONG, None, [["x"]]) == by_share  # not rows
    t = timed[4][0]  # " ill-disposed": the model's words may split one of the text's in two
    assert phrased(3.0, 21.5, LONG, None, [*timed[:4], [t, t + 0.05, " ill"], [t + 0.05, t + 0.1, "-disposed"], *timed[5:]]) == got
    assert Writer("srt").final(3.0, 21.5, LONG, None, timed) == Writer("srt").write([(c, None) for c in got])


def test_a_conversation_is_one_track_of_its_speakers_cues_written_in_the_order_they_start() -> None:
    """Two parties' finals, each channel a stream of its own, come out as one track while they speak:
    a cue is written once the other party can have no final that starts before it (its stream's
    `durable`, or its end), so the cues are in the order they start (as WebVTT requires) though a
    final of one may come after the other's that started later; numbered across both, each said to
    be its speaker's (WebVTT's voice span; in brackets before the text in SubRip)."""
    writer = Writer("vtt")
    call = Conversation(writer, [0, 1])
    assert call.said(0, Voiced("channel 1", 0.5, 2.1, "Thanks for calling.", [[0.6, 2.1, "Thanks for calling."]])) == ""
    assert call.heard(1, 2.5) == "00:00:00.600 --> 00:00:02.100\n<v channel 1>Thanks for calling.\n\n"
    assert call.said(1, Voiced("channel 2", 3.0, 5.4, "I have a question & a <complaint>.")) == ""  # channel 1 may still speak first
    assert call.heard(0, 2.2) == ""
    assert call.said(0, Voiced("channel 1", 6.0, 7.2, "Ten of clubs, you said?")) == ""
    assert call.heard(0, 8.0) == "00:00:03.000 --> 00:00:05.400\n<v channel 2>I have a question &amp; a &lt;complaint&gt;.\n\n"
    assert call.heard(1, math.inf) == "00:00:06.000 --> 00:00:07.200\n<v channel 1>Ten of clubs, you said?\n\n"
    srt = Conversation(Writer("srt"), [0, 1])
    srt.heard(0, math.inf)
    assert srt.said(1, Voiced("caller", 3.0, 5.4, "I have a question & a <complaint>.")) + srt.heard(1, math.inf) == (
        "1\n00:00:03,000 --> 00:00:05,400\n[caller] I have a question & a <complaint>.\n\n")


def test_webvtt_cue_text_cannot_end_the_cue_or_start_a_tag() -> None:
    assert Writer("vtt").final(0, 1, "a <b> & c --> d").endswith("\na &lt;b&gt; &amp; c --&gt; d\n\n")


def test_transcribe_writes_subtitles_a_player_reads(service, tmp_path) -> None:
    """`transcribe --subtitles` gives one file's finals as SubRip or WebVTT cues, from the service
    (a file, or standard input as it comes) and with `--local` alike: numbered from 1, in order,
    timed within the audio. Several files are refused: each has its own subtitles."""
    card = next(u for u in testdata.utterances() if u.name == "cards/001")
    runs = {
        "srt": ["--server", service.address, "--offline", "--subtitles", "srt", card.path],
        "local": ["--local", "--subtitles", "srt", card.path],
    }
    for name, argv in runs.items():
        done = subprocess.run([sys.executable, "-m", "streamasr.cli", "transcribe", *argv], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (name, done.stderr)
        m = re.fullmatch(r"1\n00:00:(\d\d),(\d{3}) --> 00:00:(\d\d),(\d{3})\n(.+)\n\n", done.stdout)
        assert m, (name, done.stdout)
        start, end = int(m[1]) + int(m[2]) / 1000, int(m[3]) + int(m[4]) / 1000
        assert 0 <= start < end <= 1.2 and "clubs" in m[5].lower(), (name, done.stdout)

    with open(card.path, "rb") as wav:
        raw = wav.read()[44:]  # its samples, as a pipe would carry them
    piped = subprocess.run([sys.executable, "-m", "streamasr.cli", "transcribe", "--server", service.address,
                            "--subtitles", "vtt", "-"], input=raw, capture_output=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert re.fullmatch(rb"WEBVTT\n\n00:00:\d\d\.\d{3} --> 00:00:\d\d\.\d{3}\n.*clubs.*\n\n", piped.stdout, re.I), piped.stdout

    both = subprocess.run([sys.executable, "-m", "streamasr.cli", "transcribe", "--subtitles", "srt", card.path, card.path],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--subtitles takes one file" in both.stderr, both

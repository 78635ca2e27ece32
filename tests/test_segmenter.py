"""Segmentation from VAD probabilities: synthetic sequences, invariants, and one real recording."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st

from config.settings import VadConfig
from ingest.segmenter import SegmentEvent, Segmenter
from ingest.vad import CHUNK, VadBank

CFG = VadConfig(pad_ms=200)  # threshold 0.5, min_silence 500 ms, min_speech 150 ms, max 25 s, pad 200 ms
PAD = 3200


def run(probs: list[float], cfg: VadConfig = CFG, flush: bool = False) -> list[tuple[int, SegmentEvent]]:
    """(index of the chunk whose push emitted it, event) for every event."""
    seg = Segmenter(cfg)
    out = [(i, e) for i, p in enumerate(probs) for e in seg.push(p, (i + 1) * CHUNK)]
    if flush:
        out += [(len(probs), e) for e in seg.flush(len(probs) * CHUNK)]
    return out


def spans(events: list[tuple[int, SegmentEvent]]) -> list[tuple[int, int, bool]]:
    return [(e.start, e.end, e.forced) for _, e in events if e.kind == "end"]


def test_speech_between_silences() -> None:
    events = run([0.05] * 20 + [0.9] * 50 + [0.05] * 40)
    assert [(i, e.kind) for i, e in events] == [(24, "start"), (85, "end")]
    # start announced once 150 ms of speech is seen; end once 500 ms of pause is
    assert events[0][1] == SegmentEvent("start", 20 * CHUNK - PAD)
    assert events[1][1] == SegmentEvent("end", 20 * CHUNK - PAD, 70 * CHUNK + PAD)


def test_short_bursts_are_not_segments() -> None:
    assert run([0.05] * 10 + [0.95] * 4 + [0.05] * 30) == []
    # two bursts with a short gap count as one speech run (like get_speech_timestamps)
    assert [e.kind for _, e in run([0.95] * 3 + [0.1] * 5 + [0.95] * 3 + [0.1] * 30)] == ["start", "end"]


def test_start_is_not_before_zero() -> None:
    events = run([0.9] * 10 + [0.0] * 20)
    assert spans(events) == [(0, 10 * CHUNK + PAD, False)]


def test_hysteresis() -> None:
    assert run([0.45] * 100) == []  # below threshold never triggers
    # once speaking, probabilities above threshold - 0.15 keep the segment open
    assert spans(run([0.9] * 10 + [0.4] * 100)) == []
    # and a dip below it shorter than min_silence does not end it
    events = run([0.9] * 10 + [0.2] * 15 + [0.9] * 10 + [0.2] * 16)
    assert spans(events) == [(0, 35 * CHUNK + PAD, False)]
    # a pause only ends once it has been below the low threshold for min_silence
    events = run([0.9] * 10 + [0.3] * 15 + [0.45] * 10)  # 0.45 neither resumes speech nor restarts the pause
    assert spans(events) == [(0, 10 * CHUNK + PAD, False)]


def test_padding_never_overlaps_previous_segment() -> None:
    cfg = VadConfig(pad_ms=400)
    events = run([0.9] * 10 + [0.0] * 17 + [0.9] * 10 + [0.0] * 30, cfg)
    (s1, e1, _), (s2, e2, _) = spans(events)
    assert e1 == 10 * CHUNK + 6400
    assert s2 == e1  # 27 * CHUNK - 6400 would overlap
    assert e2 == 37 * CHUNK + 6400


def test_end_capped_to_audio_seen() -> None:
    cfg = VadConfig(pad_ms=800)  # longer than min_silence
    events = run([0.9] * 10 + [0.0] * 20, cfg)
    i, end = next((i, e) for i, e in events if e.kind == "end")
    assert end.end == (i + 1) * CHUNK


def test_forced_cut_at_quietest_recent_chunk() -> None:
    cfg = VadConfig(max_segment_s=5.0)  # 80000 samples = 156.25 chunks
    probs = [0.95] * 400
    probs[60] = 0.51  # quietest overall, but more than 2 s before the limit
    probs[140] = 0.6  # quietest within the last 2 s
    probs[150] = 0.7
    events = run(probs, cfg, flush=True)
    first_end = next(e for _, e in events if e.kind == "end")
    assert first_end.forced and first_end.end == 140 * CHUNK + CHUNK // 2
    segs = spans(events)
    assert len(segs) == 3
    for (_, e1, _), (s2, _, _) in zip(segs, segs[1:]):
        assert s2 == e1  # continuous speech: the next segment starts at the cut
    assert all(e - s <= 80000 for s, e, _ in segs)
    assert segs[-1] == (segs[1][1], 400 * CHUNK, False)


def test_a_forced_cut_in_steady_speech_leaves_no_sample_out() -> None:
    """Where every chunk is as quiet as the next (steady speech, or a VAD that fails and counts
    every chunk as speech) the cut falls in the chunk that reached the limit, past the limit when
    the limit is in the chunk's first half: the segment ends at the limit, and the next one must
    start there."""
    cfg = VadConfig(max_segment_s=1.0)  # 31.25 chunks: the limit lies in a chunk's first half
    segs = spans(run([0.9] * 200, cfg, flush=True))
    assert len(segs) > 3 and segs[0][0] == 0 and segs[-1][1] == 200 * CHUNK
    for (_, e1, _), (s2, _, _) in zip(segs, segs[1:]):
        assert s2 == e1
    assert all(e - s <= 16000 for s, e, _ in segs)


def test_speech_past_the_limit_after_the_last_chunk_is_not_dropped_at_the_end() -> None:
    """The stream ends in speech that reaches max_segment_s only in the audio after the last
    full VAD chunk: the segment is cut at the limit and the rest still gets a segment, so
    every accepted sample up to the end is in a final."""
    cfg = VadConfig(max_segment_s=1.0)  # 16,000 samples: 31 chunks end at 15,872, short of it
    stream_end = 31 * CHUNK + 500
    seg = Segmenter(cfg)
    events = [e for i in range(31) for e in seg.push(0.9, (i + 1) * CHUNK)]
    segs = spans([(31, e) for e in events + seg.flush(stream_end)])
    assert segs[0][0] == 0 and segs[-1][1] == stream_end
    for (_, e1, _), (s2, _, _) in zip(segs, segs[1:]):
        assert s2 == e1
    assert all(e - s <= 16000 for s, e, _ in segs)


def test_a_short_limit_cuts_in_the_segment_s_second_half_and_a_stream_ending_after_it_closes() -> None:
    """With max_segment_s under twice the cut's look-back, a quiet chunk early in the segment
    must not be taken: the cut would leave a sliver of a segment and open one already at the
    limit, and a stream ending before its next chunk would find no chunk to cut at."""
    cfg = VadConfig(max_segment_s=1.0)  # 16,000 samples
    seg = Segmenter(cfg)
    probs = [0.9] * 32 + [0.6] + [0.9] * 30  # the quietest chunk a tenth of a second in
    events = [e for i, p in enumerate(probs) for e in seg.push(p, (i + 1) * CHUNK)]
    events += seg.flush(len(probs) * CHUNK + 400)
    segs = [(e.start, e.end) for e in events if e.kind == "end"]
    assert segs[0][0] == 0 and segs[-1][1] == len(probs) * CHUNK + 400
    for (_, e1), (s2, _) in zip(segs, segs[1:]):
        assert s2 == e1
    assert all(8000 - CHUNK <= e - s <= 16000 for s, e in segs[:-1]), segs  # forced cuts: in the second half
    assert segs[-1][1] - segs[-1][0] <= 16000
    # speech that becomes a segment only at the end, already past the limit with its padding
    seg = Segmenter(VadConfig(max_segment_s=1.0, min_speech_ms=1500, pad_ms=200))
    assert [e for i in range(46) for e in seg.push(0.9, (i + 1) * CHUNK)] == []
    assert [(e.kind, e.start, e.end) for e in seg.flush(46 * CHUNK + 500)] == [
        ("start", 0, None), ("end", 0, 16000), ("start", 16000, None), ("end", 16000, 46 * CHUNK + 500)]


def test_a_cut_on_demand_splits_speech_at_the_quietest_chunk_and_ends_a_pause_where_it_began() -> None:
    """Session cuts a segment that fills its stream's buffer: the same cut as at max_segment_s."""
    seg = Segmenter(CFG)
    assert seg.cut() == []  # nothing open
    probs = [0.95] * 40
    probs[30] = 0.6
    for i, p in enumerate(probs):
        seg.push(p, (i + 1) * CHUNK)
    cut = 30 * CHUNK + CHUNK // 2
    assert seg.cut() == [SegmentEvent("end", 0, cut, True), SegmentEvent("start", cut)]
    for i, p in enumerate([0.95] * 10 + [0.0] * 5, start=40):  # then a pause shorter than min_silence_ms
        seg.push(p, (i + 1) * CHUNK)
    # ends at the pause's start plus the padding, capped to the audio seen; no segment follows
    assert seg.cut() == [SegmentEvent("end", cut, min(50 * CHUNK + PAD, 55 * CHUNK), True)]
    assert not seg.in_speech and seg.cut() == []


def test_forced_cut_during_a_pause_ends_there() -> None:
    cfg = VadConfig(max_segment_s=5.0)
    events = run([0.95] * 150 + [0.0] * 40, cfg)
    assert [(e.kind, e.start, e.end, e.forced) for _, e in events] == [
        ("start", 0, None, False),
        ("end", 0, 150 * CHUNK + PAD, True),
    ]


def test_flush() -> None:
    seg = Segmenter(CFG)
    for i in range(20):
        seg.push(0.9, (i + 1) * CHUNK)
    assert seg.in_speech and seg.segment_start == 0
    assert seg.flush(20 * CHUNK + 100) == [SegmentEvent("end", 0, 20 * CHUNK + 100)]
    assert not seg.in_speech and seg.segment_start is None

    seg = Segmenter(CFG)  # stream ends during a pause: padded end
    for i, p in enumerate([0.9] * 20 + [0.0] * 10):
        seg.push(p, (i + 1) * CHUNK)
    assert seg.flush(30 * CHUNK) == [SegmentEvent("end", 0, 20 * CHUNK + PAD)]

    seg = Segmenter(CFG)  # speech long enough only counting the tail after the last chunk
    for i, p in enumerate([0.0] * 10 + [0.9] * 4):
        seg.push(p, (i + 1) * CHUNK)
    assert seg.flush(14 * CHUNK + 400) == [
        SegmentEvent("start", 10 * CHUNK - PAD),
        SegmentEvent("end", 10 * CHUNK - PAD, 14 * CHUNK + 400),
    ]

    seg = Segmenter(CFG)  # too short: nothing
    for i, p in enumerate([0.0] * 10 + [0.9] * 2):
        seg.push(p, (i + 1) * CHUNK)
    assert seg.flush(12 * CHUNK) == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.4, 0.45, 0.5, 0.7, 1.0]), max_size=600),
    st.integers(0, 600),
    st.sampled_from([0.0, 0.3, 0.9]),
    st.sampled_from([1.0, 1.5, 3.0]),
)
def test_invariants(probs: list[float], tail: int, run_prob: float, max_segment_s: float) -> None:
    cfg = VadConfig(max_segment_s=max_segment_s, pad_ms=300)
    limit = int(max_segment_s * 16000)
    probs = probs + [run_prob] * 100  # long runs reach the forced cut
    seg = Segmenter(cfg)
    events: list[SegmentEvent] = []
    previous = 0
    for i, p in enumerate(probs):
        earliest = seg.earliest_start
        assert earliest >= previous  # ingest can release audio monotonically
        previous = earliest
        new = seg.push(p, (i + 1) * CHUNK)
        if [e.kind for e in new] == ["end", "start"]:  # a cut in speech: the next segment takes up where it ended
            assert new[0].forced and new[1].start == new[0].end
        for e in new:
            assert e.start >= earliest  # audio before earliest_start was safe to drop
            if e.kind == "end":
                assert e.end is not None and e.start < e.end <= (i + 1) * CHUNK
                assert e.end - e.start <= limit
                if e.forced and new[-1].kind == "start":  # cut in speech: never a sliver
                    assert e.end - e.start >= limit // 2 - CHUNK
        events += new
    stream_end = len(probs) * CHUNK + tail % CHUNK
    events += seg.flush(stream_end)
    assert not seg.in_speech
    kinds = [e.kind for e in events]
    assert kinds == ["start", "end"] * (len(kinds) // 2)
    ends = [e for e in events if e.kind == "end"]
    assert all(e.end <= stream_end for e in ends)
    for a, b in zip(ends, ends[1:]):
        assert b.start >= a.end  # segments never overlap

    for s, e in zip(events[::2], events[1::2]):
        assert s.start == e.start


LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")


@pytest.mark.skipif(not LIBRIVOX.is_dir(), reason="librivox test recordings not installed")
def test_real_recordings_separated_by_a_pause() -> None:
    a, _ = sf.read(LIBRIVOX / "sense_and_sensibility_01_austen_64kb-0880.wav", dtype="float32")
    b, _ = sf.read(LIBRIVOX / "sense_and_sensibility_01_austen_64kb-0890.wav", dtype="float32")
    gap = np.zeros(32000, dtype=np.float32)
    x = np.concatenate([gap[:8000], a, gap, b, gap[:16000]])
    b_start = 8000 + len(a) + len(gap)
    bank, seg = VadBank(), Segmenter(CFG)
    bank.add("s")
    events: list[SegmentEvent] = []
    for end in range(CHUNK, len(x) + 1, CHUNK):
        events += seg.push(float(bank.process(["s"], [x[end - CHUNK : end]])[0]), end)
    events += seg.flush(len(x))
    segs = [(e.start, e.end) for e in events if e.kind == "end"]
    assert len(segs) >= 2
    # every segment is in one recording, and together they cover the speech of both
    assert all(e <= 8000 + len(a) + PAD or s >= b_start - PAD for s, e in segs)
    first = [s for s in segs if s[1] <= b_start]
    second = [s for s in segs if s[0] >= b_start - PAD]
    assert first and second and len(first) + len(second) == len(segs)
    assert first[0][0] <= 8000 + 3200 and first[-1][1] >= 8000 + len(a) - 3200
    assert second[0][0] <= b_start + 3200 and second[-1][1] >= b_start + len(b) - 3200
    assert not seg.in_speech


def test_only_the_chunks_that_decide_are_flagged() -> None:
    """The ingest has a stream's chunks classified at once when `may_decide` says they could
    start or end a segment; the others wait to be gathered with other streams'. One chunk ahead,
    it flags the chunk that completes the speech a start needs and the one that completes the
    pause an end needs, and nothing else."""
    def flagged_and_emitted(probs: list[float], cfg: VadConfig) -> tuple[list[int], list[int]]:
        seg = Segmenter(cfg)
        flagged, emitted = [], []
        for i, p in enumerate(probs):
            if seg.may_decide(CHUNK):
                flagged.append(i)
            if seg.push(p, (i + 1) * CHUNK):
                emitted.append(i)
        return flagged, emitted

    assert flagged_and_emitted([0.05] * 20 + [0.9] * 50 + [0.05] * 40, CFG) == ([24, 85], [24, 85])
    # a segment cut at max_segment_s (31.25 chunks from its start) ends, and the next starts, in the chunk that reaches it
    assert flagged_and_emitted([0.9] * 80, VadConfig(pad_ms=200, max_segment_s=1.0)) == ([4, 31, 62], [4, 31, 62])


FUTURES = [0.02, 0.4, 0.9]  # silence, the hysteresis band, speech


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(FUTURES), min_size=40, max_size=150), st.integers(1, 3))
def test_chunks_not_flagged_never_start_or_end_a_segment(probs: list[float], ahead: int) -> None:
    """Whatever the next `ahead` chunks turn out to be, `push` emits nothing for them where
    `may_decide` said it could not: no start or end is ever held back by the gathering."""
    seg = Segmenter(VadConfig(pad_ms=200, max_segment_s=1.0))  # forced cuts within reach
    for i, p in enumerate(probs):
        if not seg.may_decide(ahead * CHUNK):
            for future in itertools.product(FUTURES, repeat=ahead):
                trial = copy.deepcopy(seg)
                assert not [e for k, q in enumerate(future) for e in trial.push(q, (i + 1 + k) * CHUNK)], (i, future)
        seg.push(p, (i + 1) * CHUNK)

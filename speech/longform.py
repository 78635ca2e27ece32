"""Whisper's sequential long-form transcription over any Backend.

Audio is cut into 30 s windows. After each window the cursor moves to the last timestamp
that closed a segment; a trailing segment without a closing timestamp is decoded again at
the start of the next window (when the window ends with a lone closing timestamp, the whole
window is consumed). The previous tokens, timestamps included, are the next window's prompt
(Whisper's condition_on_previous_text), except after a window the temperature fallback
sampled above 0.5. Segment times are absolute.

Backends with `transcribe_tokens` (OrtWhisperBackend) get exactly that, each window with
Whisper's temperature fallback (`speech.decoding`); any other Backend
gets the same cursor logic from its segments (a trailing segment ending at the window's
duration is the unclosed one) and the previous text as a text prompt.
"""

from __future__ import annotations

import math

import numpy as np

from speech.backend import MAX_WINDOW_S, MIN_REST_S, SAMPLE_RATE, Backend, DecodeRequest, DecodeResult, Segment
from speech.words import moved

WINDOW = int(MAX_WINDOW_S * SAMPLE_RATE)
TIME_PRECISION = 0.02
PROMPT_CHARS = 600
FRESH_PROMPT_ABOVE = 0.5  # a window decoded at a higher fallback temperature does not prompt the next


def transcribe(backend: Backend, audio: np.ndarray, language: str | None = None, prompt: str | None = None) -> DecodeResult:
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if hasattr(backend, "transcribe_tokens") and hasattr(backend, "tokenizer"):
        return _transcribe_tokens(backend, audio, language, prompt)
    return _transcribe_text(backend, audio, language, prompt)


def _finish(text: str, segments, language, logprobs, no_speech, n_tokens, words=None) -> DecodeResult:
    return DecodeResult(
        text=text,
        segments=segments,
        words=words or [],
        language=language or "en",
        avg_logprob=float(np.mean(logprobs)) if logprobs else 0.0,
        no_speech_prob=float(np.mean(no_speech)) if no_speech else 0.0,
        tokens=n_tokens,
    )


def _transcribe_tokens(backend, audio, language, prompt) -> DecodeResult:
    tk = backend.tokenizer
    tb = tk.timestamp_begin
    total = len(audio)
    seek = 0
    history: list[int] = tk.encode(" " + prompt.strip()) if prompt else []
    segments: list[Segment] = []
    timed: list[Segment] | None = []  # the kept segments' words, while the backend times them
    # the kept segments' text tokens, decoded together as Whisper's text is: joining the segments'
    # texts with spaces would put spaces into Chinese or Japanese, whose words have none
    text_tokens: list[int] = []
    logprobs, no_speech, n_tokens = [], [], 0
    while total - seek > int(MIN_REST_S * SAMPLE_RATE) or (seek == 0 and total > 0):
        chunk = audio[seek : seek + WINDOW]
        dur = len(chunk) / SAMPLE_RATE
        req = DecodeRequest(audio=chunk, language=language)
        res, toks = backend.transcribe_tokens([req], [history or None])[0]
        language = res.language  # the model's code for it, or the one detected in the first window
        offset = seek / SAMPLE_RATE
        toks = [t for t in toks if t < tk.eot or t >= tb]
        if not res.text:  # silence (no-speech rule) or nothing decoded: skip the window
            seek += len(chunk)
            continue
        logprobs.append(res.avg_logprob)
        no_speech.append(res.no_speech_prob)
        n_tokens += res.tokens
        is_ts = [t >= tb for t in toks]
        single_ending = len(toks) >= 2 and not is_ts[-2] and is_ts[-1]
        consecutive = [i for i in range(1, len(toks)) if is_ts[i] and is_ts[i - 1]]
        advance = len(chunk)
        if consecutive:
            slices = consecutive + ([len(toks)] if single_ending else [])
            last = 0
            for cur in slices:
                part = toks[last:cur]
                start = (part[0] - tb) * TIME_PRECISION if part and part[0] >= tb else 0.0
                end = (part[-1] - tb) * TIME_PRECISION if part and part[-1] >= tb else dur
                words = [t for t in part if t < tk.eot]
                if _add(segments, offset, start, end, tk.decode(words), dur):
                    text_tokens += words
                last = cur
            if not single_ending:
                last_ts = (toks[last - 1] - tb) * TIME_PRECISION
                advance = int(last_ts * SAMPLE_RATE)
            used = toks[:last] if not single_ending else toks
        else:
            stamps = [t for t in toks if t >= tb]
            end = dur
            if stamps and stamps[-1] != tb:
                end = (stamps[-1] - tb) * TIME_PRECISION
            start = (stamps[0] - tb) * TIME_PRECISION if stamps and toks[0] >= tb else 0.0
            words = [t for t in toks if t < tk.eot]
            if _add(segments, offset, start, end, tk.decode(words), dur):
                text_tokens += words
            used = toks
        # Whisper's rule: text sampled hot is no context to condition the next window on
        history = [] if res.temperature > FRESH_PROMPT_ABOVE else (history + used)[-223:]
        # Whisper's seek, however early in the window the last segment closed; only a window whose
        # text closed nothing before 0.00 (never seen) moves half a second, so as not to decode it again
        seek += (advance or SAMPLE_RATE // 2) if advance < len(chunk) else len(chunk)
        if timed is not None and res.words:
            _add_words(timed, res.words, offset, dur, tk.decode([t for t in used if t < tk.eot]))
        else:
            timed = None  # a window without word times: the text's words are not all timed
    return _finish(tk.decode(text_tokens).strip(), segments, language, logprobs, no_speech, n_tokens, timed)


def _add_words(timed: list[Segment], window: list[Segment], offset: float, dur: float, kept: str) -> None:
    """Append the words of a window's kept text (its first words: the rest is decoded again in
    the next window) at absolute times, after the words before them."""
    text, count = "", 0
    for w in window:
        if not kept.strip().startswith((text + w.text).strip()):
            break
        text += w.text
        count += 1
    timed += moved(window[:count], offset, timed[-1].end if timed else 0.0, dur)


def _add(segments: list[Segment], offset: float, start: float, end: float, text: str, dur: float) -> bool:
    """Append a segment at absolute times; False when its text is blank and nothing was added."""
    text = text.strip()
    if not text:
        return False
    start = offset + min(max(start, 0.0), dur)
    end = offset + min(max(end, 0.0), dur)
    if segments and start < segments[-1].end:
        start = segments[-1].end
    end = max(end, start)
    # rounded to the centisecond, but never up past the audio's end (a segment closed at the last sample)
    last = math.floor(round((offset + dur) * 100, 6)) / 100
    end = min(round(end, 2), last)
    segments.append(Segment(min(round(start, 2), end), end, text))
    return True


def _transcribe_text(backend: Backend, audio, language, prompt) -> DecodeResult:
    total = len(audio)
    seek = 0
    segments: list[Segment] = []
    logprobs, no_speech, n_tokens = [], [], 0
    context = prompt
    while total - seek > int(MIN_REST_S * SAMPLE_RATE) or (seek == 0 and total > 0):
        chunk = audio[seek : seek + WINDOW]
        dur = len(chunk) / SAMPLE_RATE
        res = backend.transcribe_batch([DecodeRequest(audio=chunk, language=language, prompt=context)])[0]
        language = language or res.language
        logprobs.append(res.avg_logprob)
        no_speech.append(res.no_speech_prob)
        n_tokens += res.tokens
        segs = list(res.segments)
        advance = len(chunk)
        if len(chunk) == WINDOW and len(segs) >= 2 and abs(segs[-1].end - dur) < 1e-6 and segs[-1].start >= 1.0:
            advance = int(segs[-1].start * SAMPLE_RATE)  # unclosed trailing segment: decode it again
            segs = segs[:-1]
        offset = seek / SAMPLE_RATE
        for s in segs:
            _add(segments, offset, s.start, s.end, s.text, dur)
        if segs:
            context = " ".join(s.text for s in segments)[-PROMPT_CHARS:]
        seek += advance
    text = " ".join(s.text for s in segments)  # a backend without tokens gives the segments' texts only
    return _finish(text, segments, language, logprobs, no_speech, n_tokens)

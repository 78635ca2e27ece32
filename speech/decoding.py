"""Whisper decoding over the exported ONNX graphs: greedy or beam search, batched.

Follows openai/whisper's decoding.py: the SOT sequence (<|startoftranscript|>, language,
task, <|notimestamps|> when timestamps are off), an optional <|startofprev|> prompt (last
223 tokens), an optional forced prefix, suppress tokens, blank suppression at the first
sampled step, the timestamp rules (pairs, monotonic, first timestamp <= 1.0 s, timestamp
forced when their summed probability beats every text token), at most 224 sampled tokens,
average log-probability and the no-speech probability at the SOT position.

A partial may not end at a segment it opened more than PARTIAL_OPEN_END_S before its audio's
end: Whisper leaves such words to a next window, which a partial never has.

A decode on the full window (a final, a long-form window, a partial there) samples at most
`window_token_cap` tokens for its audio's length, and one that reaches it is a loop. Unless it
is a partial, Whisper's temperature fallback then decodes it again by sampling, best of
`best_of`, at each temperature step up to 1.0, until a sample ends before the cap. With
`whisper_rule` (long-form transcription) the fallback also takes Whisper's other cases: text
that compresses more than 2.4 times, or reads unsure (average log-probability under -1, unless
the no-speech rule calls it silence). When no temperature passes, the least unsure result that
is not a loop is kept (faster-whisper's rule; Whisper keeps the last). A request's samples are
seeded from its audio, so the same audio gives the same text. Partials never fall back: the
next one replaces them within a partial interval. A final's fallback samples at the first
FALLBACK_ROUNDS temperatures only, so it holds a worker a bounded number of decodes longer and
its text never depends on the machine's speed; long-form windows, read off-line, try every
temperature.

Batching: all requests of one window size share one encoder call (B, n_mels, T) and then step
together. Rows are left-padded; the decoder gets explicit positions and an additive mask, so
padding columns in the self-attention cache are never attended; every input and output of
the graphs is a view of a buffer the decoder keeps (`speech.graphio`). Prefill runs in two calls:
(prompt + SOT) gives the no-speech probability and language logits at the SOT position; the
rest of the forced tokens follow (the language is known by then). As in Whisper, the language
is detected from SOT alone: when a row to detect has a prompt, one SOT step comes first and
the cache starts over. Finished rows leave the batch.

A result's last segment that was not closed by a timestamp ends at the request's audio
duration; `speech.longform` relies on this to re-decode an incomplete trailing segment.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from speech import words
from speech.backend import MAX_WINDOW_S, MIN_REST_S, SAMPLE_RATE, DecodeRequest, DecodeResult, Segment
from speech.graphio import Group, GraphIO
from speech.mel import FRAMES_PER_SECOND, N_FRAMES, LogMel
from speech.tokenizer import TIME_PRECISION, WhisperTokenizer

SAMPLE_LEN = 224
MAX_PROMPT = 223  # prompt tokens after <|startofprev|> (n_text_ctx // 2 - 1)
MAX_PREFIX = 200  # forced prefix tokens kept (the rest of 448 positions is for the prompt and output)
NO_SPEECH_THRESHOLD = 0.6
LOGPROB_THRESHOLD = -1.0
MAX_INITIAL_TIMESTAMP = 1.0
COMPRESSION_RATIO_THRESHOLD = 2.4
WINDOW_TOKENS_PER_S = 15
# A final's fallback samples at this many temperatures at most: a loop in a 25 s segment is 224
# tokens, and five rounds of five samples of it would keep a worker towards `[workers]
# stuck_after_s` with a larger model. The loops measured were mended within two rounds (three for
# one), and a round of a long segment's five samples takes about twice its greedy decode. A count
# of rounds, not a time, so the text is the same however busy the machine (docs/PERFORMANCE.md,
# "Loops and the temperature fallback").
FALLBACK_ROUNDS = 3
# A partial may not open a segment and end there (two timestamps, or its first, then the end of
# text) unless the segment opens within this many seconds of its audio's end: Whisper leaves the
# words after such a timestamp to the next 30 s window, which a partial never decodes, so a
# partial of a long segment stopped there, short of words already heard, for seconds on end
# (docs/PERFORMANCE.md, "A partial that opens a segment and stops"). Within it the rest is a word
# cut off or the pause that will end the segment.
PARTIAL_OPEN_END_S = 1.0
# A final whose decode opens a segment and stops there (two timestamps, then the end of text) is
# decoded on from that timestamp, as Whisper's transcribe seeks: at most this many times more,
# and not for a rest shorter than MIN_REST_S.
DECODE_ON_ROUNDS = 3


def compression_ratio(text: str) -> float:
    """How much zlib shrinks the text: a decode that repeats itself compresses far better than speech."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def _is_loop(res: DecodeResult) -> bool:
    return compression_ratio(res.text) > COMPRESSION_RATIO_THRESHOLD


def needs_fallback(res: DecodeResult) -> bool:
    """Whisper's rule: a loop, or unsure text that the no-speech rule does not call silence."""
    silence = res.no_speech_prob > NO_SPEECH_THRESHOLD and res.avg_logprob < LOGPROB_THRESHOLD
    return _is_loop(res) or (res.avg_logprob < LOGPROB_THRESHOLD and not silence)


@dataclass
class DecodeOptions:
    beam_size: int = 1
    partial_window: str = "short"  # "short" | "full"
    quick_first_partial: bool = True  # a segment's first partial on the short window even when partial_window is "full"
    sample_len: int = SAMPLE_LEN
    suppress_silence: bool = True  # no_speech_prob > 0.6 and avg_logprob < -1 -> empty result
    temperature_increment: float = 0.2  # fallback temperatures: this step up to 1.0; 0 = no fallback
    best_of: int = 5  # samples per request at each fallback temperature
    word_times: bool = False  # a final's words timed by the alignment heads (`speech.words`)

    @property
    def fallback_temperatures(self) -> list[float]:
        step = self.temperature_increment
        return [round(step * k, 6) for k in range(1, int(1.0 / step + 1e-6) + 1)] if step > 0 else []


@dataclass
class _Row:
    """One hypothesis being decoded."""

    req: int  # index of its request in the group
    tokens: list[int] = field(default_factory=list)  # forced-after-SOT (ts + prefix) + sampled
    n_forced: int = 0
    sum_logprob: float = 0.0
    done: bool = False


def _ranking_score(row: _Row) -> float:
    """How beam search ranks finished hypotheses: Whisper's MaximumLikelihoodRanker without a
    length penalty, the summed log-probability (its end-of-text included) over the number of
    tokens sampled before the end of text. Dividing by one more, as the average log-probability
    of a result does, would favour short hypotheses."""
    return row.sum_logprob / max(1, len(row.tokens) - row.n_forced)


def _log_softmax(x: np.ndarray, out: np.ndarray, scratch: np.ndarray, col: np.ndarray) -> np.ndarray:
    """Over the last axis, into `out`, with `scratch` for the exponentials and `col` (rows, 1)
    for each row's maximum and sum: a decoding step allocates no array for it."""
    y = np.subtract(x, x.max(axis=-1, keepdims=True, out=col), out=out)
    total = np.exp(y, out=scratch).sum(axis=-1, keepdims=True, out=col)
    y -= np.log(total, out=total)
    return y


def _top(x: np.ndarray, k: int) -> list[int]:
    """Indices of the k largest values of `x`, best first, found by k passes of argmax (each
    found one masked, then all put back): argpartition would return an index array the size of
    the vocabulary at every step, and negating `x` for it another."""
    picked: list[tuple[int, np.float32]] = []
    for _ in range(k):
        i = int(x.argmax())
        picked.append((i, x[i]))
        x[i] = -np.inf
    for i, value in reversed(picked):  # reversed: an index picked twice (all -inf) gets its first value back
        x[i] = value
    return [i for i, _ in picked]


def window_token_cap(n_samples: int) -> int:
    """Most tokens sampled for a decode on the full 30 s window (finals, long-form windows,
    partials on it): WINDOW_TOKENS_PER_S per second of its audio, twice the density of Whisper's
    own cap (224 tokens for 30 s), plus room for the timestamps of a short clip. A decode that
    reaches it is a loop; without it a loop in a three-second segment ran to 224 tokens, four
    times the work, and all of it repetition."""
    return math.ceil(WINDOW_TOKENS_PER_S * n_samples / SAMPLE_RATE) + 10


def short_window_frames(n_samples: int) -> int:
    """Mel frames for a short partial window: speech + 2 s, rounded up to whole seconds."""
    seconds = math.ceil(n_samples / SAMPLE_RATE + 2.0)
    return min(N_FRAMES, max(1, seconds) * FRAMES_PER_SECOND)


class WhisperDecoder:
    def __init__(self, encoder, decoder, tokenizer: WhisperTokenizer, dims: dict, options: DecodeOptions):
        # the sessions' inputs and outputs, in kept buffers; the encoded audio kept for word times
        self.io = GraphIO(encoder, decoder, dims, keep_encoded=options.word_times)
        self.tk = tokenizer
        self.opt = options
        self.vocab = dims["vocab"]
        # tokens between the tokenizer's specials and the model's vocabulary that are not timestamps
        self.suppress = np.array([t for t in tokenizer.suppress_tokens if t < self.vocab], dtype=np.int64)
        self.suppress_begin = np.array([t for t in tokenizer.suppress_begin if t < self.vocab], dtype=np.int64)
        self.ts_begin = tokenizer.timestamp_begin
        self.max_initial_ts = round(MAX_INITIAL_TIMESTAMP / TIME_PRECISION)
        # one group at a time: its features are encoded before the next group's
        self.log_mel = LogMel(dims["n_mels"])
        self._logprobs = np.empty((0, self.vocab), np.float32)  # a step's log-probabilities, rows as needed
        self._exp = np.empty((0, self.vocab), np.float32)
        self._col = np.empty((0, 1), np.float32)  # a per-row reduction
        self._best = np.empty(0, np.int64)  # a step's greedy choices

    # ---------------------------------------------------------------------------------- public
    def decode(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        return [r for r, _ in self.decode_tokens(requests)]

    def decode_tokens(
        self, requests: Sequence[DecodeRequest], prompt_tokens: Sequence[list[int] | None] | None = None,
        whisper_rule: bool = False, rounds_on: int = DECODE_ON_ROUNDS,
    ) -> list[tuple[DecodeResult, list[int]]]:
        """Results with the decoded tokens (timestamps included, after the SOT sequence).

        `prompt_tokens` (per request) replaces the text prompt with token ids, as Whisper's
        long-form transcription conditions on previous tokens including timestamps.
        `whisper_rule`: the temperature fallback for text that compresses or reads unsure too,
        not only for decodes that reach their cap. `rounds_on`: how many more times a final
        that stopped at a segment it opened is decoded on from there (`_decode_on`).
        """
        ptoks = list(prompt_tokens) if prompt_tokens is not None else [None] * len(requests)
        results: list[tuple[DecodeResult, list[int]] | None] = [None] * len(requests)
        groups: dict[int, list[int]] = {}
        caps: dict[int, int] = {}
        sizes = [int(np.asarray(r.audio).shape[-1]) for r in requests]
        for i, (r, n) in enumerate(zip(requests, sizes)):
            if r.partial and (self.opt.partial_window == "short" or (r.first and self.opt.quick_first_partial)):
                frames = short_window_frames(n)
                if frames < N_FRAMES:
                    groups.setdefault(frames, []).append(i)
                    caps[i] = math.ceil(7 * n / SAMPLE_RATE) + 5
                    continue
            caps[i] = window_token_cap(n)
            groups.setdefault(N_FRAMES, []).append(i)
        retry: list[int] = []
        looped: set[int] = set()  # finals that reached their cap
        for frames, idx in sorted(groups.items()):
            outs = self._decode_group([requests[i] for i in idx], frames, [caps.get(i) for i in idx], [ptoks[i] for i in idx])
            for i, (res, capped, toks) in zip(idx, outs):
                if capped and frames < N_FRAMES:
                    retry.append(i)  # hit the short-window token cap: decode again on the full window
                    continue
                if capped and not requests[i].partial:
                    looped.add(i)
                results[i] = (res, toks)
        if retry:
            outs = self._decode_group([requests[i] for i in retry], N_FRAMES, [window_token_cap(sizes[i]) for i in retry],
                                      [ptoks[i] for i in retry])
            for i, (res, _, toks) in zip(retry, outs):
                results[i] = (res, toks)
        self._fall_back(requests, ptoks, results, caps, looped, whisper_rule)  # type: ignore[arg-type]
        if not whisper_rule and rounds_on > 0:  # long-form transcription seeks by itself
            self._decode_on(requests, sizes, ptoks, results, rounds_on)  # type: ignore[arg-type]
        return results  # type: ignore[return-value]

    def _decode_on(self, requests: Sequence[DecodeRequest], sizes: list[int], ptoks: list[list[int] | None],
                   results: list[tuple[DecodeResult, list[int]]], rounds: int) -> None:
        """Finals whose tokens end with two timestamps: the last segment closed, the next one
        opened and left empty, Whisper taking the words after it for the next 30 s window's (a
        segment cut in mid-speech). Whisper's transcribe decodes on from the closing timestamp;
        so does this, in place in `results`, conditioned on the tokens so far, the rest's
        segments following at their times in the request's audio. Partials are redone anyway."""
        tb, eot = self.ts_begin, self.tk.eot
        todo: list[tuple[int, int]] = []
        for i, (r, n) in enumerate(zip(requests, sizes)):
            res, toks = results[i]
            if r.partial or not r.timestamps or not res.text or len(toks) < 2 or toks[-1] < tb or toks[-2] < tb:
                continue
            seek = round((toks[-2] - tb) * TIME_PRECISION * SAMPLE_RATE)
            if 0 < seek and n - seek > MIN_REST_S * SAMPLE_RATE:
                todo.append((i, seek))
        if not todo:
            return
        rests, prompts = [], []
        for i, seek in todo:
            r, (res, toks) = requests[i], results[i]
            before = list(ptoks[i] or []) or self.tk.prompt_tokens(r.prompt, MAX_PROMPT)[1:]  # without <|startofprev|>
            prompts.append((before + [t for t in toks[:-1] if t < eot or t >= tb])[-MAX_PROMPT:])
            rests.append(DecodeRequest(audio=np.asarray(r.audio)[..., seek:], language=res.language))
        for (i, seek), rest in zip(todo, self.decode_tokens(rests, prompts, rounds_on=rounds - 1)):
            results[i] = self._joined(results[i], rest, seek / SAMPLE_RATE)

    def _joined(self, first: tuple[DecodeResult, list[int]], rest: tuple[DecodeResult, list[int]],
                shift: float) -> tuple[DecodeResult, list[int]]:
        """A result and the result of its audio from `shift` seconds on, as one."""
        (a, a_toks), (b, b_toks) = first, rest
        if not b.text:
            return first
        tb, k = self.ts_begin, round(shift / TIME_PRECISION)
        last = tb + round(MAX_WINDOW_S / TIME_PRECISION)  # <|30.00|>
        toks = a_toks[:-1] + [min(t + k, last) if t >= tb else t for t in b_toks]
        segments = a.segments + [Segment(min(round(s.start + shift, 2), round(s.end + shift, 3)), round(s.end + shift, 3), s.text)
                                 for s in b.segments]
        # words for the whole text, or none: the rest's follow the first's
        timed = a.words + words.moved(b.words, shift, a.words[-1].end) if a.words and b.words else []
        res = DecodeResult(
            text=self.tk.decode([t for t in toks if t < self.tk.eot]).strip(), segments=segments, language=a.language,
            avg_logprob=(a.avg_logprob * (a.tokens + 1) + b.avg_logprob * (b.tokens + 1)) / (a.tokens + b.tokens + 2),
            no_speech_prob=a.no_speech_prob, tokens=a.tokens + b.tokens, fell_back=a.fell_back or b.fell_back,
            temperature=max(a.temperature, b.temperature), words=timed,
        )
        return res, toks

    def _fall_back(self, requests: Sequence[DecodeRequest], ptoks: list[list[int] | None],
                   results: list[tuple[DecodeResult, list[int]]], caps: dict[int, int], looped: set[int],
                   whisper_rule: bool) -> None:
        """Decode again, in place in `results`, the requests that `looped` (reached their token
        cap) and with `whisper_rule` those whose text compresses or reads unsure; see the
        module's docstring. Without `whisper_rule`, at the first FALLBACK_ROUNDS temperatures only."""
        def fails(res: DecodeResult, capped: bool) -> bool:
            return capped or (whisper_rule and needs_fallback(res))

        if not self.opt.fallback_temperatures:
            return
        todo = [i for i, r in enumerate(requests) if not r.partial and fails(results[i][0], i in looped)]
        tried = {i: [(results[i], i in looped)] for i in todo}
        temperatures = self.opt.fallback_temperatures if whisper_rule else self.opt.fallback_temperatures[:FALLBACK_ROUNDS]
        for temperature in temperatures:
            if not todo:
                break
            outs = self._decode_group([requests[i] for i in todo], N_FRAMES, [caps[i] for i in todo], [ptoks[i] for i in todo],
                                      temperature=temperature)
            still = []
            for i, (res, capped, toks) in zip(todo, outs):
                res.temperature = temperature
                tried[i].append(((res, toks), capped))
                results[i] = (res, toks)
                if fails(res, capped):
                    still.append(i)
            todo = still
        for i in todo:
            no_loop = [t for t, capped in tried[i] if not capped and not (whisper_rule and _is_loop(t[0]))]
            results[i] = max(no_loop or [t for t, _ in tried[i]], key=lambda t: t[0].avg_logprob)
        for i in tried:
            results[i][0].fell_back = True

    # -------------------------------------------------------------------------------- internals
    def _rows(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(n, V) buffers for log-probabilities and their exponentials, (n, 1) for a per-row
        reduction (and the greedy choices beside them), grown to the largest batch."""
        if len(self._logprobs) < n:
            self._logprobs = np.empty((n, self.vocab), np.float32)
            self._exp = np.empty((n, self.vocab), np.float32)
            self._col = np.empty((n, 1), np.float32)
            self._best = np.empty(n, np.int64)
        return self._logprobs[:n], self._exp[:n], self._col[:n]

    def _open_end(self, req: DecodeRequest) -> int:
        """The first timestamp token at which `req` may open a segment and end its text (see
        PARTIAL_OPEN_END_S): 0, any, but for a partial with timestamps."""
        if not req.partial or not req.timestamps:
            return 0
        duration = np.asarray(req.audio).shape[-1] / SAMPLE_RATE
        return self.ts_begin + max(0, math.ceil((duration - PARTIAL_OPEN_END_S) / TIME_PRECISION))

    def _filter(self, logits: np.ndarray, rows: list[_Row], ts_on: list[bool], first: list[bool],
                open_ends: list[int]) -> np.ndarray:
        """Apply Whisper's logit filters in place to (n, V) logits, and a partial's rule against
        ending at a segment it opened (`open_ends`, from `_open_end`); returns log-probabilities,
        in a buffer the next step overwrites."""
        logits[:, self.suppress] = -np.inf
        tb = self.ts_begin
        for k, row in enumerate(rows):
            if first[k]:
                logits[k, self.suppress_begin] = -np.inf
            if not ts_on[k]:
                logits[k, tb:] = -np.inf
                continue
            logits[k, self.tk.no_timestamps] = -np.inf
            seq = row.tokens
            last_ts = len(seq) >= 1 and seq[-1] >= tb
            penult_ts = len(seq) < 2 or seq[-2] >= tb
            if last_ts:
                if penult_ts:
                    logits[k, tb:] = -np.inf
                    if seq[-1] < open_ends[k]:  # a segment opened before the audio's last second: its words
                        logits[k, self.tk.eot] = -np.inf
                else:
                    logits[k, : self.tk.eot] = -np.inf
            stamps = [x for x in seq if x >= tb]
            if stamps:
                last = stamps[-1] if (last_ts and not penult_ts) else stamps[-1] + 1
                logits[k, tb:last] = -np.inf
            else:
                # first sampled token: must be a timestamp, at most MAX_INITIAL_TIMESTAMP
                logits[k, :tb] = -np.inf
                logits[k, tb + self.max_initial_ts + 1 :] = -np.inf
        logprobs, exp, col = self._rows(len(rows))
        _log_softmax(logits, logprobs, exp, col)
        for k in range(len(rows)):
            if ts_on[k]:
                stamps = logprobs[k, tb:]
                top = stamps.max()
                if not np.isfinite(top):
                    continue  # every timestamp is suppressed
                e = np.subtract(stamps, top, out=exp[k, tb:])
                ts_lp = top + np.log(np.exp(e, out=e).sum())  # log of the timestamps' summed probability
                if ts_lp > logprobs[k, :tb].max():
                    logits[k, :tb] = -np.inf
                    _log_softmax(logits[k : k + 1], logprobs[k : k + 1], exp[k : k + 1], col[k : k + 1])
        return logprobs

    def _decode_group(
        self, reqs: list[DecodeRequest], frames: int, caps: list[int | None], ptoks: list[list[int] | None],
        temperature: float = 0.0,
    ) -> list[tuple[DecodeResult, bool, list[int]]]:
        """Greedy or beam search at temperature 0; best of `best_of` samples above it."""
        tk = self.tk
        n = len(reqs)
        beam = max(1, self.opt.beam_size)
        copies = max(1, self.opt.best_of) if temperature > 0 else beam
        group = self.io.encode(self.log_mel([r.audio for r in reqs], frames), n * copies)

        # stage 1: prompt + SOT -> no-speech probability and language at the SOT position
        stage1 = []
        for r, pt in zip(reqs, ptoks):
            if pt:
                ctx = [tk.sot_prev] + list(pt)[-MAX_PROMPT:]
            else:
                ctx = tk.prompt_tokens(r.prompt, MAX_PROMPT)
            n_prefix = len(tk.encode(" " + r.prefix.strip())) if r.prefix and r.prefix.strip() else 0
            room = MAX_PROMPT + 1 - max(0, min(n_prefix, MAX_PREFIX) - 16)  # a long prefix shortens the prompt
            if len(ctx) > room:
                ctx = [ctx[0]] + ctx[len(ctx) - room + 1 :] if room > 1 else []
            stage1.append(ctx + [tk.sot])
        languages: list[str | None] = []
        for r in reqs:
            if not tk.multilingual:
                languages.append("en")
            else:  # None, or a code the model does not know: detect
                languages.append(tk.language_code(r.language))
        detect = [i for i, lang in enumerate(languages) if lang is None]
        if any(len(stage1[i]) > 1 for i in detect):
            # Whisper detects the language from <|startoftranscript|> alone: after a prompt, the
            # prompt's language would outweigh the audio's. The cache then starts over.
            self._detect(self.io.step([[tk.sot]] * n, group, into=0), detect, languages)
            self.io.restart(group)
        logits = self.io.step(stage1, group, into=0)
        no_speech = np.zeros(n)
        if tk.no_speech is not None:
            no_speech = np.exp(_log_softmax(logits, *self._rows(n))[:, tk.no_speech])
        self._detect(logits, [i for i in detect if languages[i] is None], languages)

        # stage 2: rest of the SOT sequence, <|notimestamps|>, forced timestamp + prefix
        stage2, forced = [], []
        for i, r in enumerate(reqs):
            seq = tk.sot_sequence(languages[i])[1:]
            pre: list[int] = []
            if r.prefix and r.prefix.strip():
                pre = tk.encode(" " + r.prefix.strip())[:MAX_PREFIX]
                if r.timestamps:
                    pre = [self.ts_begin] + pre
            if not r.timestamps:
                seq.append(tk.no_timestamps)
            stage2.append(seq + pre)
            forced.append(pre)
        # the first sampled token's logits, in buffer 1 (the decoding loops read them from there)
        if any(stage2):
            first_logits = self.io.step(stage2, group, into=1)
            for i, s2 in enumerate(stage2):
                if not s2:  # nothing more was forced: its first token comes from the SOT position
                    first_logits[i] = logits[i]
        else:
            first_logits = self.io.logits(1, n)
            first_logits[:] = logits

        # every position must fit the decoder's positional embedding (448)
        max_new = [
            max(1, min(self.opt.sample_len if not c else min(self.opt.sample_len, c), self.io.n_ctx - len(s1) - len(s2)))
            for c, s1, s2 in zip(caps, stage1, stage2)
        ]
        if temperature > 0:
            finals = self._sample(reqs, group, first_logits, forced, max_new, temperature, copies)
        elif beam == 1:
            finals = self._greedy(reqs, group, first_logits, forced, max_new)
        else:
            finals = self._beam(reqs, group, first_logits, forced, max_new, beam)

        out = []
        for i, r in enumerate(reqs):
            row, capped = finals[i]
            out.append((self._result(r, row, languages[i], float(no_speech[i])), capped, list(row.tokens)))
        if self.io.keep_encoded:
            self._time_words(reqs, out)
        return out

    def _time_words(self, reqs: list[DecodeRequest], out: list[tuple[DecodeResult, bool, list[int]]]) -> None:
        """The words of the group's finals, timed against the audio the group encoded (one
        decoder prefill for them all, `speech.words`). A decode that reached its cap is left
        without: it is decoded again."""
        tk = self.tk
        todo = [i for i, (r, (res, capped, _)) in enumerate(zip(reqs, out)) if not r.partial and res.text and not capped]
        if not todo:
            return
        texts = [[t for t in out[i][2] if t < tk.eot] for i in todo]
        heads = [tk.sot_sequence(out[i][0].language) for i in todo]
        feeds = [head + [tk.no_timestamps] + text + [tk.eot] for head, text in zip(heads, texts)]
        scores = self.io.align(todo, feeds)
        width = scores.shape[2]
        for k, i in enumerate(todo):
            samples = int(np.asarray(reqs[i].audio).shape[-1])
            first = width - len(feeds[k]) + len(heads[k])  # the row predicting the first text token (rows are left-padded)
            rows = scores[k, :, first : width - 1, : min(words.frames_of(samples), scores.shape[3])]
            out[i][0].words = words.timed(rows, texts[k], tk, samples / SAMPLE_RATE, out[i][0].language)

    def _detect(self, logits: np.ndarray, rows: list[int], languages: list[str | None]) -> None:
        """Set languages[i] for each of `rows` to its most likely language token in (n, V) `logits`."""
        ids = np.array([t for t in self.tk.lang_ids if t < self.vocab])
        for i in rows:
            languages[i] = self.tk.id_to_lang[int(ids[np.argmax(logits[i, ids])])]

    def _sample(self, reqs, group: Group, logits, forced, max_new, temperature: float, copies: int):
        """`copies` samples of each request at `temperature`; each request's best by Whisper's
        ranking, among those that ended if any did (one the token cap cut is most likely a loop)."""
        n = len(reqs)
        every = [i for i in range(n) for _ in range(copies)]
        rep = self.io.take(group, every)
        logits = np.take(logits, rep, axis=0, out=self.io.logits(0, n * copies), mode="clip")
        # one generator per request, seeded from its audio: its samples do not depend on its batch
        rngs = [np.random.default_rng([zlib.crc32(np.ascontiguousarray(r.audio, dtype=np.float32).tobytes()),
                                       round(temperature * 1000)]) for r in reqs]
        samples = self._greedy([reqs[i] for i in every], group, logits, [forced[i] for i in every],
                               [max_new[i] for i in every], temperature, [rngs[i] for i in every])
        out = []
        for i in range(n):
            mine = samples[i * copies : (i + 1) * copies]
            ended = [s for s in mine if not s[1]]
            out.append(max(ended or mine, key=lambda s: _ranking_score(s[0])))
        return out

    def _draw(self, lp: np.ndarray, temperature: float, rngs: list[np.random.Generator]) -> np.ndarray:
        """One token per row of (n, V) log-probabilities, drawn with the row's generator from
        their distribution at `temperature`: by the cumulative sum of its unnormalised
        probabilities, in the buffer `_filter` is done with (noise for every token of the
        vocabulary would cost as much as the decoder step)."""
        n = len(lp)
        cdf = np.multiply(lp, 1.0 / temperature, out=self._exp[:n])
        cdf -= cdf.max(axis=-1, keepdims=True, out=self._col[:n])
        np.cumsum(np.exp(cdf, out=cdf), axis=-1, out=cdf)
        picks = self._best[:n]
        for k, rng in enumerate(rngs):
            picks[k] = min(int(np.searchsorted(cdf[k], rng.random() * cdf[k, -1], side="right")), lp.shape[1] - 1)
        return picks

    def _greedy(self, reqs, group: Group, logits, forced, max_new, temperature: float = 0.0,
                rngs: list[np.random.Generator] | None = None):
        """The most likely token at each step, or at `temperature` > 0 one drawn with each row's
        generator of `rngs` (`_draw`)."""
        rows = [_Row(req=i, tokens=list(forced[i]), n_forced=len(forced[i])) for i in range(len(reqs))]
        ts_on = [r.timestamps for r in reqs]
        open_ends = [self._open_end(r) for r in reqs]
        active = list(range(len(reqs)))
        capped = [False] * len(reqs)
        n_sampled = 0
        while active:
            cur = [rows[i] for i in active]
            lp = self._filter(logits, cur, [ts_on[i] for i in active], [n_sampled == 0] * len(active),
                              [open_ends[i] for i in active])
            if rngs is None:
                nxt = lp.argmax(axis=-1, out=self._best[: len(active)])
            else:
                nxt = self._draw(lp, temperature, [rngs[i] for i in active])
            keep, feed = [], []
            for k, i in enumerate(active):
                tok = int(nxt[k])
                rows[i].sum_logprob += float(lp[k, tok])
                if tok == self.tk.eot:
                    rows[i].done = True
                    continue
                rows[i].tokens.append(tok)
                if n_sampled + 1 >= max_new[i]:
                    capped[i] = True
                    continue
                keep.append(k)
                feed.append([tok])
            n_sampled += 1
            if len(keep) != len(active):
                active = [active[k] for k in keep]
                if active:
                    self.io.take(group, keep)
            if not active:
                break
            logits = self.io.step(feed, group, into=1)
        return [(rows[i], capped[i]) for i in range(len(reqs))]

    def _beam(self, reqs, group: Group, logits, forced, max_new, beam):
        n = len(reqs)
        ts_on = [r.timestamps for r in reqs]
        open_ends = [self._open_end(r) for r in reqs]
        # every request starts with `beam` copies of its hypothesis; only the first expands at step 0
        rep = self.io.take(group, [i for i in range(n) for _ in range(beam)])
        logits = np.take(logits, rep, axis=0, out=self.io.logits(0, n * beam), mode="clip")
        beams = [[_Row(req=i, tokens=list(forced[i]), n_forced=len(forced[i])) for _ in range(beam)] for i in range(n)]
        finished: list[list[_Row]] = [[] for _ in range(n)]
        capped = [False] * n
        active = list(range(n))  # requests still decoding; rows in state are active x beam
        n_sampled = 0
        while active:
            flat = [b for i in active for b in beams[i]]
            lp = self._filter(logits, flat, [ts_on[b.req] for b in flat], [n_sampled == 0] * len(flat),
                              [open_ends[b.req] for b in flat])
            new_rows_idx, feed, still = [], [], []
            for a, i in enumerate(active):
                cands: dict[tuple, tuple[float, int, int]] = {}
                for j in range(beam if n_sampled > 0 else 1):
                    k = a * beam + j
                    row = flat[k]
                    for tok in _top(lp[k], beam + 1):
                        s = row.sum_logprob + float(lp[k, tok])
                        key = tuple(row.tokens) + (int(tok),)
                        if key not in cands or cands[key][0] < s:
                            cands[key] = (s, k, int(tok))
                ranked = sorted(cands.values(), key=lambda c: -c[0])
                kept: list[_Row] = []
                for s, k, tok in ranked:
                    src = flat[k]
                    if tok == self.tk.eot:
                        if len(finished[i]) < beam:
                            finished[i].append(_Row(req=i, tokens=list(src.tokens), n_forced=src.n_forced, sum_logprob=s, done=True))
                        continue
                    kept.append(_Row(req=i, tokens=src.tokens + [tok], n_forced=src.n_forced, sum_logprob=s))
                    new_rows_idx.append(k)
                    feed.append([tok])
                    if len(kept) == beam:
                        break
                while len(kept) < beam:  # all candidates ended: keep padding rows (never used)
                    kept.append(kept[-1] if kept else _Row(req=i, tokens=list(beams[i][0].tokens), done=True))
                    new_rows_idx.append(new_rows_idx[-1] if new_rows_idx and len(kept) > 1 else a * beam)
                    feed.append(feed[-1] if feed and len(kept) > 1 else [self.tk.eot])
                beams[i] = kept
                if len(finished[i]) >= beam:
                    # drop this request's rows
                    del new_rows_idx[-beam:]
                    del feed[-beam:]
                elif n_sampled + 1 >= max_new[i]:
                    capped[i] = True
                    del new_rows_idx[-beam:]
                    del feed[-beam:]
                else:
                    still.append(i)
            n_sampled += 1
            active = still
            if not active:
                break
            self.io.take(group, new_rows_idx)
            logits = self.io.step(feed, group, into=0)
        out = []
        for i in range(n):
            # Unlike Whisper's finalize, hypotheses the token cap cut are candidates only when none
            # ended: a cut one is a loop more often than not, and a partial that hit the cap is
            # decoded again on the full window instead.
            cands = finished[i] or [b for b in beams[i] if not b.done] or beams[i]
            if not finished[i]:
                capped_i = capped[i]
            else:
                capped_i = False
            best = max(cands, key=_ranking_score)
            out.append((best, capped_i))
        return out

    def _result(self, req: DecodeRequest, row: _Row, language: str, no_speech: float) -> DecodeResult:
        tb = self.ts_begin
        sampled = len(row.tokens) - row.n_forced
        avg = row.sum_logprob / (sampled + 1)
        duration = float(np.asarray(req.audio).shape[-1]) / SAMPLE_RATE
        if self.opt.suppress_silence and no_speech > NO_SPEECH_THRESHOLD and avg < LOGPROB_THRESHOLD:
            return DecodeResult(text="", segments=[], language=language, avg_logprob=avg, no_speech_prob=no_speech, tokens=sampled)
        text_tokens = [t for t in row.tokens if t < self.tk.eot]
        text = self.tk.decode(text_tokens).strip()
        segments: list[Segment] = []
        if not req.timestamps:
            if text:
                segments.append(Segment(0.0, round(duration, 3), text))
        else:
            start: float | None = None
            last_end = 0.0
            cur: list[int] = []
            for t in row.tokens:
                if t >= tb:
                    # Whisper may place a timestamp past the audio's end (up to 30 s): a segment
                    # never ends after the audio it was heard in.
                    time = min((t - tb) * TIME_PRECISION, duration)
                    if start is not None and cur:
                        seg_text = self.tk.decode(cur).strip()
                        if seg_text:
                            segments.append(Segment(min(round(start, 2), duration), min(round(time, 2), duration), seg_text))
                        cur, start, last_end = [], None, time
                    else:
                        start = time
                elif t < self.tk.eot:
                    if start is None:
                        start = last_end
                    cur.append(t)
            if cur:
                seg_text = self.tk.decode(cur).strip()
                if seg_text:
                    # a start rounded to the centisecond may pass the end rounded to the millisecond
                    end = round(duration, 3)
                    segments.append(Segment(min(round(start or 0.0, 2), end), end, seg_text))
        return DecodeResult(
            text=text, segments=segments, language=language, avg_logprob=avg, no_speech_prob=no_speech, tokens=sampled
        )

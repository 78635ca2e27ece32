"""Word times for a final: Whisper's alignment of a decoded text to its audio (openai/whisper's
`timing.py`), on the exported graphs.

A few of the decoder's cross-attention heads (the model's alignment heads, `speech.export`)
attend to the audio where each token is spoken. The decoder reads the SOT sequence,
<|notimestamps|>, the text and <|endoftext|> in one prefill (`GraphIO.align`); the scores of the
positions that predict each text token and the end are softmaxed over the audio's frames,
normalised per frame across the tokens, median-filtered along time and averaged over the heads.
Dynamic time warping then finds the cheapest monotonic path of the tokens through the frames:
a token starts at the frame where the path reaches it. Tokens join into words at spaces (each
character is a word in the languages written without them), punctuation joins the word it
belongs to, and a word stretched over a pause (the first one after a long silence, one at a
sentence's end) is cut to twice the median word's length, as Whisper does. Times are seconds
in the request's audio, in steps of one encoder frame (20 ms).
"""

from __future__ import annotations

import math
import string
from typing import Sequence

import numpy as np

from speech.backend import Segment
from speech.tokenizer import WhisperTokenizer

FRAME_S = 0.02  # one encoder frame: two 10 ms mel frames
SAMPLES_PER_FRAME = 320
MEDIAN_WIDTH = 7
PREPEND = "\"'“¿([{-"  # punctuation that joins the word after it
APPEND = "\"'.。,，!！?？:：”)]}、"  # punctuation that joins the word before it
SENTENCE_ENDS = ".。!！?？"
UNSPACED = frozenset({"zh", "ja", "th", "lo", "my", "yue"})  # languages written without spaces between words
MAX_MEDIAN_S = 0.7  # the median word length taken is at most this


def moved(words: list[Segment], shift: float, after: float, within: float = math.inf) -> list[Segment]:
    """`words` timed in audio that starts `shift` seconds on (each time first held `within` its
    own audio's seconds), none before `after`: the end of the words that come before them."""
    return [Segment(round(max(shift + min(w.start, within), after), 3), round(max(shift + min(w.end, within), after), 3), w.text)
            for w in words]


def frames_of(samples: int) -> int:
    """The encoder frames `samples` of 16 kHz audio take."""
    return max(1, -(-samples // SAMPLES_PER_FRAME))


def timed(scores: np.ndarray, text: Sequence[int], tk: WhisperTokenizer, duration: float, language: str) -> list[Segment]:
    """The words of `text` (its tokens, no specials) with their times, from `scores` (A, N + 1,
    frames): the alignment heads' scores of the N + 1 positions that predict the text's tokens
    and then the end of text, over the request's audio of `duration` seconds. `scores` is
    overwritten: softmaxed and normalised in place, so a final's words take no copy of it, only
    one head's median filter at a time and the warping's cost matrix."""
    if not text:
        return []
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    scores -= scores.mean(axis=-2, keepdims=True)
    scores /= np.maximum(scores.std(axis=-2, keepdims=True), 1e-10)
    matrix = np.zeros(scores.shape[1:], np.float64)
    for head in scores:
        matrix += median7(head)
    matrix /= len(scores)
    token_at, frame_at = dtw(-matrix)
    starts = frame_at[np.diff(token_at, prepend=-1) > 0] * FRAME_S  # each token's first frame, and the end's
    words = split(list(text), tk, language)
    bounds = np.cumsum([0] + [len(tokens) for _, tokens in words])
    out = [Segment(float(starts[a]), float(starts[b]), word) for (word, _), a, b in zip(words, bounds[:-1], bounds[1:])]
    median, longest = _lengths(out)
    _shorten(out, longest)
    out = _with_punctuation(out)
    if out and median > 0:
        _shorten_first(out, median, longest)
    for w in out:
        w.start, w.end = round(min(w.start, duration), 3), round(min(w.end, duration), 3)
    return out


# a sorting network of seven (16 compare-exchanges): element 3 of the seven then is their median
_SORT7 = ((0, 6), (2, 3), (4, 5), (0, 2), (1, 4), (3, 6), (0, 1), (2, 5), (3, 4), (1, 2), (4, 6), (2, 3), (4, 5),
          (1, 2), (3, 4), (5, 6))


def median7(x: np.ndarray) -> np.ndarray:
    """Each value of 2-D `x` the median of the seven around it along the last axis, mirrored at the
    ends (as Whisper's filter, MEDIAN_WIDTH 7): the seven shifted rows sorted by a network of
    elementwise minima and maxima, several times quicker than numpy's median of a sliding window."""
    if x.shape[-1] <= MEDIAN_WIDTH // 2:
        return x
    padded = np.pad(x, [(0, 0), (3, 3)], mode="reflect")
    n = x.shape[-1]
    shifted = [padded[:, i : i + n].copy() for i in range(MEDIAN_WIDTH)]
    for i, j in _SORT7:
        low = np.minimum(shifted[i], shifted[j])
        np.maximum(shifted[i], shifted[j], out=shifted[j])
        shifted[i] = low
    return shifted[3]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through (N, M) `cost` from (0, 0) to (N - 1, M - 1), each step
    one row, one column or both on: its rows and columns, in order. A row's cumulative costs
    come in one pass: with a the cost of entering column j from the row above, the row's
    cumulative cost is min over k <= j of (a_k + the cost of columns k+1..j), a running minimum
    of a minus the row's prefix sums, plus them."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    for i in range(1, n + 1):
        row = cost[i - 1].astype(np.float64)
        enter = row + np.minimum(total[i - 1, :-1], total[i - 1, 1:])
        prefix = np.cumsum(row)
        total[i, 1:] = np.minimum.accumulate(enter - prefix) + prefix
    # back from the end, each step to the cheapest of the three cells before it (diagonal, then
    # the row above, then the column before on ties, as Whisper's trace does)
    i, j = n, m
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        if i == 0:
            j -= 1
        elif j == 0:
            i -= 1
        else:
            diag, up, left = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
            if diag < up and diag < left:
                i, j = i - 1, j - 1
            elif up < diag and up < left:
                i -= 1
            else:
                j -= 1
    steps = np.array(path[::-1])
    return steps[:, 0], steps[:, 1]


def split(tokens: list[int], tk: WhisperTokenizer, language: str) -> list[tuple[str, list[int]]]:
    """`tokens` as words, each its text (with the space before it) and its tokens: at spaces and
    punctuation, or at each character in languages written without spaces."""
    pieces = tk.characters(tokens)
    if language in UNSPACED:
        return pieces
    words: list[tuple[str, list[int]]] = []
    for text, ids in pieces:
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append((text, list(ids)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + ids)
    return words


def _lengths(words: list[Segment]) -> tuple[float, float]:
    """The median word's length (at most MAX_MEDIAN_S) and twice it, the longest a word is let be
    where a pause is beside it."""
    lengths = [w.end - w.start for w in words if w.end > w.start]
    median = min(MAX_MEDIAN_S, float(np.median(lengths))) if lengths else 0.0
    return median, 2 * median


def _shorten(words: list[Segment], longest: float) -> None:
    """A sentence's last mark, or the word after it, that the path stretched over the pause
    between them is cut to `longest`."""
    for i in range(1, len(words)):
        w = words[i]
        if w.end - w.start > longest:
            if w.text in SENTENCE_ENDS:
                w.end = w.start + longest
            elif words[i - 1].text in SENTENCE_ENDS:
                w.start = w.end - longest


def _shorten_first(words: list[Segment], median: float, longest: float) -> None:
    """The first word after a long silence (the final's lead-in) takes that silence into its
    path: it is cut to `longest`, and the second with it if that one is long too."""
    first = words[0]
    if first.end > 4 * median and (first.end - first.start > longest
                                   or (len(words) > 1 and words[1].end - first.start > 2 * longest)):
        if len(words) > 1 and words[1].end - words[1].start > longest:
            first.end = words[1].start = max(words[1].end / 2, words[1].end - longest)
        first.start = max(0.0, first.end - longest)


def _with_punctuation(words: list[Segment]) -> list[Segment]:
    """Punctuation joined to its word, as Whisper joins it: an opening mark (with a space before
    it) to the word after, a closing one (with none) to the word before; the word's times stay."""
    following = len(words) - 1
    for i in range(len(words) - 2, -1, -1):
        mark = words[i]
        if mark.text.startswith(" ") and mark.text.strip() in PREPEND:
            words[following].text, mark.text = mark.text + words[following].text, ""
        else:
            following = i
    out: list[Segment] = []
    for w in words:
        if not w.text:
            continue
        if out and not out[-1].text.endswith(" ") and w.text in APPEND:
            out[-1].text += w.text
        else:
            out.append(w)
    return out

"""LocalAgreement-2: which words of a partial transcript are safe to show as settled.

Each partial decode re-transcribes the segment so far, and Whisper's last words flicker
between decodes. A word is committed once two consecutive hypotheses agree on it and on
everything before it, and the newer one has heard past it; later partials never take a
committed word back, so clients can print them. The final is decoded on the whole segment,
free of the committed words, and is the transcript: it keeps them when it has the same words
and says so when it does not (`Final.revised`) — a partial's early mistake must not become
the record.

Words are what spaces separate, and each character of the scripts written without spaces
(Chinese, Japanese): a Chinese partial is one "word" to a split on spaces, and its last word is
never committed, so nothing of it would ever be.
"""

from __future__ import annotations

import re

# Whisper writes a number as a word in one decode and in digits in the next ("Eight" / "8")
_NUMBERS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_NUMBERS.update({w: str(10 * i) for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), 3)})
_NUMBERS.update({tens + unit: str(int(_NUMBERS[tens]) + int(_NUMBERS[unit]))  # "twenty-one" / "21"
                 for tens in "twenty thirty forty fifty sixty seventy eighty ninety".split()
                 for unit in "one two three four five six seven eight nine".split()})

# CJK symbols and punctuation, kana, CJK ideographs (and extension A, compatibility), fullwidth forms
_SPACELESS = "\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_WORD = re.compile(f"(\\s*)([{_SPACELESS}]|[^\\s{_SPACELESS}]+)")


def words(text: str) -> list[str]:
    """`text` as words, each with the one space that went before it, if any: joined, they are the
    text with its spaces made single (a Chinese text gains none)."""
    return [(" " if space else "") + word for space, word in _WORD.findall(text)]


def _text(words: list[str]) -> str:
    return "".join(words).lstrip()


def word_key(word: str) -> str:
    """Comparison key: case, punctuation and number spelling differ between decodes of the same word."""
    key = "".join(c for c in word.casefold() if c.isalnum())
    return _NUMBERS.get(key, key)


class LocalAgreement:
    """Commits the longest common word prefix of the last two hypotheses; never retracts a commit."""

    def __init__(self) -> None:
        self._committed: list[str] = []
        self._committed_keys: list[str] = []
        self._pending: list[str] | None = None  # previous hypothesis past the committed words

    @property
    def committed(self) -> str:
        return _text(self._committed)

    def update(self, hypothesis: str) -> tuple[str, str]:
        """Feed the newest full-segment hypothesis; returns (text, stable).

        `stable` is the committed words; `text` is those followed by the rest of this hypothesis.
        """
        tail = self._after_committed(words(hypothesis))
        if self._pending is not None:
            agreed = 0
            # the last word sits at the edge of the audio heard, possibly cut mid-word: never committed
            for old, new in zip(self._pending, tail[:-1]):
                if word_key(old) != word_key(new):
                    break
                agreed += 1
            self._committed += tail[:agreed]  # spelled as in the newest hypothesis
            self._committed_keys += [word_key(w) for w in tail[:agreed]]
            tail = tail[agreed:]
        self._pending = tail
        return _text(self._committed + tail), self.committed

    def finalize(self, final_text: str) -> tuple[str, bool]:
        """The segment's final text, and whether it revised committed words.

        Where the final has the committed words (compared by `word_key`) its
        spelling is kept: it was decoded on the whole segment. A final that found nothing keeps
        the committed words rather than erase what two partials agreed on.
        """
        final = words(final_text)
        if not final:
            return self.committed, False
        revised = [word_key(w) for w in final[: len(self._committed_keys)]] != self._committed_keys
        return _text(final), revised

    def _after_committed(self, hypothesis: list[str]) -> list[str]:
        """The words of `hypothesis` that come after the committed ones.

        Usually the hypothesis repeats the committed words verbatim; when the decoder changed
        its mind about them, cut where its prefix is closest (word edit distance) to them.
        """
        k = len(self._committed_keys)
        keys = [word_key(w) for w in hypothesis]
        if keys[:k] == self._committed_keys:
            return hypothesis[k:]
        # dist[j] = edit distance between the committed words and keys[:j], one row per committed word
        dist = list(range(len(keys) + 1))
        for i, committed in enumerate(self._committed_keys, 1):
            prev, dist = dist, [i] + [0] * len(keys)
            for j, key in enumerate(keys, 1):
                dist[j] = min(prev[j] + 1, dist[j - 1] + 1, prev[j - 1] + (committed != key))
        best = min(range(len(dist)), key=lambda j: (dist[j], -j))  # ties: later, so words don't repeat
        return hypothesis[best:]

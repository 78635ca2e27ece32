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
import unicodedata

# Whisper writes a number in words in one decode and in digits in the next ("Eight" / "8",
# "a hundred and five" / "105"): a number spelled out, in however many words, is one word
# whose key is its digits (see `_spelled`)
_SMALL = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}
_SMALL.update(_TENS)
_SMALL.update({tens + unit: _TENS[tens] + _SMALL[unit]  # "twenty-one", keyed without its hyphen
               for tens in _TENS for unit in "one two three four five six seven eight nine".split()})
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9}

# CJK symbols and punctuation, kana, CJK ideographs (and extension A, compatibility), fullwidth forms
_SPACELESS = "\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_WORD = re.compile(f"(\\s*)([{_SPACELESS}]|[^\\s{_SPACELESS}]+)")
_SPACELESS_CHAR = re.compile(f"[{_SPACELESS}]")


def words(text: str) -> list[str]:
    """`text` as words, each with the one space that went before it, if any: joined, they are the
    text with its spaces made single (a Chinese text gains none)."""
    return [(" " if space else "") + word for space, word in _WORD.findall(text)]


def joined(texts: list[str]) -> str:
    """Texts one after another (a stream's finals) as one text: a space between two, none between
    two of a script written without spaces (Chinese, Japanese), as Whisper's own text has none there."""
    out = ""
    for text in filter(None, (t.strip() for t in texts)):
        out += "" if not out or (_SPACELESS_CHAR.fullmatch(out[-1]) and _SPACELESS_CHAR.fullmatch(text[0])) else " "
        out += text
    return out


def _text(words: list[str]) -> str:
    return "".join(words).lstrip()


def _key(word: str) -> str:
    """Case and punctuation differ between decodes of the same word. Combining marks stay: in
    Devanagari or Thai they are the vowels ("कम" and "काम" are two words)."""
    return "".join(c for c in word.casefold() if c.isalnum() or unicodedata.category(c)[0] == "M")


def _spelled(keys: list[str], i: int) -> tuple[int, int]:
    """The number spelled out in words from keys[i]: (how many words, its value); (0, 0) if none.

    Cardinals as Whisper writes them: "five", "twenty five", "a hundred and five", "two
    thousand twenty four", "twelve hundred". Numbers said one after another ("one two three")
    are three numbers, not six.
    """
    total, group, prev, taken = 0, 0, "", 0
    for j in range(i, len(keys)):
        k, nxt = keys[j], keys[j + 1] if j + 1 < len(keys) else ""
        value = _SMALL.get(k)
        if k == "a" and not prev and (nxt == "hundred" or nxt in _SCALES):
            group, prev = 1, "a"
        elif value is not None and (not prev or prev in ("hundred", "and", "scale")):
            group, prev = (value if prev == "scale" else group + value), ("tens" if k in _TENS else "small")
        elif value is not None and prev == "tens" and value < 10:
            group, prev = group + value, "small"
        elif k == "hundred" and prev in ("a", "small", "tens") and 0 < group < 100:
            group, prev = group * 100, "hundred"
        elif k in _SCALES and prev in ("a", "small", "tens", "hundred") and group:
            total, group, prev = total + group * _SCALES[k], 0, "scale"
        elif k == "and" and prev in ("hundred", "scale") and nxt in _SMALL:
            prev = "and"
            continue
        else:
            break
        if prev != "a":
            taken = j - i + 1
    return taken, total + group


_NUMBER_WORDS = (*_SMALL, "hundred", *_SCALES)


def _may_go_on(key: str) -> bool:
    """Whether the word heard last (maybe cut short: "f", "hun") may go on a number before it."""
    return key.isdigit() or any(w.startswith(key) for w in _NUMBER_WORDS)


def groups(text: str) -> tuple[list[str], list[str]]:
    """`text` as words (see `words`), a number spelled out in several words joined into one, and
    each one's comparison key: case, punctuation and number spelling differ between decodes of
    the same words."""
    ws = words(text)
    plain = [_key(w) for w in ws]
    out: list[str] = []
    out_keys: list[str] = []
    i = 0
    while i < len(ws):
        n, value = _spelled(plain, i)
        if n:
            out.append("".join(ws[i : i + n]))
            out_keys.append(str(value))
            i += n
        else:
            out.append(ws[i])
            out_keys.append(plain[i])
            i += 1
    return out, out_keys


def keys(text: str) -> list[str]:
    """The comparison keys of `text`'s words (see `groups`): two texts with the same keys say the same."""
    return groups(text)[1]


class LocalAgreement:
    """Commits the longest common word prefix of the last two hypotheses; never retracts a commit."""

    def __init__(self) -> None:
        self._committed: list[str] = []
        self._committed_keys: list[str] = []
        self._pending: list[str] | None = None  # keys of the previous hypothesis past the committed words

    @property
    def committed(self) -> str:
        return _text(self._committed)

    def update(self, hypothesis: str) -> tuple[str, str]:
        """Feed the newest full-segment hypothesis; returns (text, stable).

        `stable` is the committed words; `text` is those followed by the rest of this hypothesis.
        """
        tail, tail_keys = self._after_committed(*groups(hypothesis))
        if self._pending is not None:
            agreed = 0
            # the last word sits at the edge of the audio heard, possibly cut mid-word: never committed,
            # nor is it followed by punctuation of its own ("。"), which no audio was heard past
            heard = max((i for i, key in enumerate(tail_keys) if key), default=0)
            for old, new in zip(self._pending, tail_keys[:heard]):
                if old != new:
                    break
                agreed += 1
            if agreed and agreed == heard and tail_keys[agreed - 1].isdigit() and _may_go_on(tail_keys[heard]):
                agreed -= 1  # "twenty" of "twenty f…": the number may go on ("twenty five", "25"), held back
            if agreed:  # spelled as in the newest hypothesis; regrouped, as "twenty" then "five" are one number
                self._committed, self._committed_keys = groups(_text(self._committed + tail[:agreed]))
            tail, tail_keys = tail[agreed:], tail_keys[agreed:]
        self._pending = tail_keys
        return _text(self._committed + tail), self.committed

    def finalize(self, final_text: str) -> tuple[str, bool]:
        """The segment's final text, and whether it revised committed words.

        Where the final has the committed words (compared by their keys, see `groups`) its
        spelling is kept: it was decoded on the whole segment. A final that found nothing keeps
        the committed words rather than erase what two partials agreed on.
        """
        final, final_keys = groups(final_text)
        if not final:
            return self.committed, False
        revised = final_keys[: len(self._committed_keys)] != self._committed_keys
        return _text(final), revised

    def _after_committed(self, hypothesis: list[str], keys: list[str]) -> tuple[list[str], list[str]]:
        """The words of `hypothesis` (and their keys) that come after the committed ones.

        Usually the hypothesis repeats the committed words verbatim; when the decoder changed
        its mind about them, cut where its prefix is closest (word edit distance) to them.
        """
        k = len(self._committed_keys)
        if keys[:k] == self._committed_keys:
            return hypothesis[k:], keys[k:]
        # the committed words end inside a number the hypothesis goes on with ("twenty" of
        # "twenty five"): the rest of it follows them, rather than being dropped with the number
        spoken, said = words("".join(hypothesis)), words(self.committed)
        if [_key(w) for w in spoken[:len(said)]] == [_key(w) for w in said]:
            return groups("".join(spoken[len(said):]))
        # dist[j] = edit distance between the committed words and keys[:j], one row per committed word
        dist = list(range(len(keys) + 1))
        for i, committed in enumerate(self._committed_keys, 1):
            prev, dist = dist, [i] + [0] * len(keys)
            for j, key in enumerate(keys, 1):
                dist[j] = min(prev[j] + 1, dist[j - 1] + 1, prev[j - 1] + (committed != key))
        best = min(range(len(dist)), key=lambda j: (dist[j], -j))  # ties: later, so words don't repeat
        return hypothesis[best:], keys[best:]

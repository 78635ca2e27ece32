"""Word times' numerics (`speech.words`): the median filter, the warping path, words from tokens.
The timing of real speech is tested with the model (`test_speech_decode.py`, `test_service_e2e.py`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from config.settings import ModelConfig
from speech import words
from speech.backend import Segment
from speech.loader import resolve_model
from speech.tokenizer import WhisperTokenizer


@pytest.fixture(scope="module")
def tk() -> WhisperTokenizer:
    return WhisperTokenizer(resolve_model(ModelConfig(name="whisper-tiny.en")).dir)


def test_the_median_filter_is_the_median_of_seven_mirrored_at_the_ends() -> None:
    """Every 0/1 input of seven (a sorting network that sorts those sorts everything) and random
    rows against numpy's median of the mirrored window."""
    for bits in itertools.product([0.0, 1.0], repeat=7):
        assert words.median7(np.array([bits], np.float32))[0, 3] == sorted(bits)[3], bits
    x = np.random.default_rng(1).standard_normal((5, 40)).astype(np.float32)
    window = np.lib.stride_tricks.sliding_window_view(np.pad(x, [(0, 0), (3, 3)], mode="reflect"), 7, axis=-1)
    assert np.array_equal(words.median7(x), np.median(window, axis=-1))
    short = np.ones((2, 3), np.float32)
    assert words.median7(short) is short  # nothing to mirror: as Whisper leaves it


def _dtw_by_cells(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whisper's warping, cell by cell, with its trace."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    trace = np.full((n + 1, m + 1), -1)
    total[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
            c, t = (c0, 0) if c0 < c1 and c0 < c2 else (c1, 1) if c1 < c0 and c1 < c2 else (c2, 2)
            total[i, j] = cost[i - 1, j - 1] + c
            trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        i, j = (i - 1, j - 1) if trace[i, j] == 0 else (i - 1, j) if trace[i, j] == 1 else (i, j - 1)
    steps = np.array(path[::-1])
    return steps[:, 0], steps[:, 1]


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (6, 1), (5, 40), (12, 30)])
def test_the_warping_path_is_whispers(shape: tuple[int, int]) -> None:
    """The path each row's running minimum gives is the one the cell-by-cell recursion gives."""
    for seed in range(5):
        cost = np.random.default_rng(seed).standard_normal(shape)
        rows, cols = words.dtw(cost)
        expected = _dtw_by_cells(cost)
        assert np.array_equal(rows, expected[0]) and np.array_equal(cols, expected[1]), (shape, seed)
        assert rows[0] == cols[0] == 0 and rows[-1] == shape[0] - 1 and cols[-1] == shape[1] - 1


def test_tokens_join_into_words_and_punctuation_joins_its_word(tk: WhisperTokenizer) -> None:
    """At spaces, punctuation its own piece until it joins the word before it ("meters.") or, opening,
    the word after it; in a language written without spaces, each character is a word."""
    tokens = tk.encode(' He said "go forward 10 meters." Then (slowly) stop.')
    split = words.split(tokens, tk, "en")
    assert "".join(w for w, _ in split) == ' He said "go forward 10 meters." Then (slowly) stop.'
    assert sum(len(ids) for _, ids in split) == len(tokens)
    merged = words._with_punctuation([Segment(float(i), float(i + 1), w) for i, (w, _) in enumerate(split)])
    assert [w.text for w in merged] == [" He", " said", ' "go', " forward", " 10", ' meters."', " Then", " (slowly)", " stop."]
    assert (merged[-1].start, merged[-1].end) == (9.0, 10.0)  # " stop" keeps its times, "." joined it
    assert [w for w, _ in words.split(tk.encode("天气很好"), tk, "zh")] == list("天气很好")

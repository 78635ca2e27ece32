"""The Whisper graphs' inputs and outputs in buffers one decoder keeps, bound with ONNX Runtime's
IOBinding: a decoding step allocates no array.

Fed a dict of arrays, ONNX Runtime returns every output (a step's logits, each layer's grown
self-attention cache) in fresh memory, and the step's token, position and mask inputs are new
arrays too. Here every input and output is a view of a flat buffer sized for the largest batch
the decoder has served and for the longest sequences a decode can reach (1,500 audio frames; twice
the model's 448 text positions for the caches, since a batch's rows are left-padded to one
length: a long prompt in one row and a long prefix in another each pad the other), so shapes may
vary from step to step while the memory stays. Pages are touched only as far as the views
reach, so a short decode keeps little of that resident.

The caches go back and forth between two sides: a step reads the past from one side and writes
the present (past and the step's new keys and values, the graph's Concat) to the other, since an
ONNX Runtime output must not alias an input. Dropping or repeating rows (finished rows, beam
search) copies them to the other side the same way. One group of requests is decoded at a time,
so the sides are this object's state. With `keep_encoded` the encoder writes its cross-attention
keys and values to a third buffer that no row change overwrites, so once a group is decoded its
finals can be aligned word by word (`align`) without encoding their audio again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

NEG = np.float32(-1e9)  # additive mask for a column a position must not attend


class _Pair:
    """Two flat buffers of one kind: the side in use, and the one the next write goes to."""

    __slots__ = ("bufs", "i")

    def __init__(self, size: int, dtype: type) -> None:
        self.bufs = (np.empty(size, dtype), np.empty(size, dtype))
        self.i = 0

    @property
    def cur(self) -> np.ndarray:
        return self.bufs[self.i]

    @property
    def other(self) -> np.ndarray:
        return self.bufs[1 - self.i]

    def flip(self) -> None:
        self.i = 1 - self.i


def _address(arr: np.ndarray) -> int:
    """Where an array's data starts: what IOBinding writes an output to."""
    return arr.__array_interface__["data"][0]


def _view(flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The contiguous prefix of `flat` as an array of `shape`."""
    return flat[: math.prod(shape)].reshape(shape)


@dataclass(slots=True)
class Group:
    """A batch being decoded: its rows and how many positions its self-attention cache holds."""

    rows: int
    past: int = 0


class GraphIO:
    """Runs the encoder and decoder sessions for `speech.decoding` on kept buffers."""

    def __init__(self, encoder, decoder, dims: dict, keep_encoded: bool = False) -> None:
        self.enc = encoder  # onnxruntime.InferenceSession
        self.dec = decoder
        self.aligning = len(dims.get("alignment_heads", ()))  # the alignment heads the decoder gives (0: none)
        self.keep_encoded = keep_encoded and self.aligning > 0
        self.layers = int(dims["n_dec"])
        self.heads = int(dims["dec_heads"])
        self.dh = int(dims["d"]) // self.heads
        self.vocab = int(dims["vocab"])
        self.n_ctx = int(dims.get("n_text_ctx", 448))  # positions a row's tokens may take
        self.cache_len = 2 * self.n_ctx  # cache columns a padded batch may reach
        self.n_audio = int(dims.get("n_audio_ctx", 1500))
        self.cross_names = [f"cross_{kv}_{i}" for i in range(self.layers) for kv in "kv"]
        self.past_names = [f"past_{kv}_{i}" for i in range(self.layers) for kv in "kv"]
        self.present_names = [f"present_{kv}_{i}" for i in range(self.layers) for kv in "kv"]
        self._enc_io = encoder.io_binding()
        self._dec_io = decoder.io_binding()
        self._align_io = decoder.io_binding()  # its own: a step binds no alignment output
        self._home: list[np.ndarray] = []  # with keep_encoded: the group's encoded requests, per cross name
        self._on_home = False  # the group's rows are still the encoded requests, read from `_home`
        self._encoded = 0  # the requests `_home` holds
        self._scores = np.empty(0, np.float32)  # `align`'s output
        # an additive causal mask for a prefill: position i attends columns <= i
        self._causal = np.triu(np.full((self.n_ctx, self.n_ctx), NEG, np.float32), 1)
        self._arange = np.arange(self.n_ctx, dtype=np.int64)
        self._capacity = 0
        self._frames = 0  # cross-attention length of the group being decoded
        self._reserve(1)

    def _reserve(self, rows: int) -> None:
        """Buffers for `rows` rows at the model's longest sequences; grown, never shrunk."""
        if rows <= self._capacity:
            return
        h, dh, ctx, cache = self.heads, self.dh, self.n_ctx, self.cache_len
        self._kv = [_Pair(rows * h * cache * dh, np.float32) for _ in range(2 * self.layers)]
        self._cross = [_Pair(rows * h * self.n_audio * dh, np.float32) for _ in range(2 * self.layers)]
        self._bias = _Pair(rows * cache, np.float32)  # per row and cache column: 0 attended, NEG padding
        self._count = _Pair(rows, np.int64)  # per row: real (not padding) positions so far
        self._taken = np.empty(rows, np.int64)  # the rows a take keeps
        self._tokens = np.empty(rows * ctx, np.int64)
        self._positions = np.empty(rows * ctx, np.int64)
        self._mask = np.empty(rows * ctx * cache, np.float32)
        self._logits = (np.empty(rows * self.vocab, np.float32), np.empty(rows * self.vocab, np.float32))
        self._capacity = rows

    def logits(self, side: int, rows: int) -> np.ndarray:
        """(rows, V) of a logits buffer: steps write one of two, so a group can keep the first
        call's logits while the second runs."""
        return _view(self._logits[side], (rows, self.vocab))

    # ------------------------------------------------------------------------------------ encoder
    def encode(self, mel: np.ndarray, most_rows: int) -> Group:
        """Encode (B, n_mels, T) features into the cross-attention keys and values of a new group;
        `most_rows` is the most rows the group will hold (beam search repeats each request)."""
        b = mel.shape[0]
        self._reserve(max(b, most_rows))
        frames = mel.shape[2] // 2
        io = self._enc_io
        io.bind_cpu_input("mel", np.ascontiguousarray(mel))
        self._frames = frames
        size = b * self.heads * self.n_audio * self.dh
        if self.keep_encoded and (not self._home or self._home[0].size < size):
            self._home = [np.empty(size, np.float32) for _ in self.cross_names]
        self._on_home = self.keep_encoded
        self._encoded = b
        for j, (name, pair) in enumerate(zip(self.cross_names, self._cross)):
            pair.i = 0
            view = self._cross_view(self._source(j, pair), name, b)
            io.bind_output(name, "cpu", 0, np.float32, view.shape, _address(view))
        self.enc.run_with_iobinding(io)
        for pair in self._kv:
            pair.i = 0
        self._bias.i = self._count.i = 0
        _view(self._count.cur, (b,))[:] = 0
        self._bind_cross(b)
        return Group(rows=b)

    def _cross_view(self, flat: np.ndarray, name: str, rows: int) -> np.ndarray:
        # keys are stored transposed for q @ k: (B, H, Dh, S); values (B, H, S, Dh)
        if name.startswith("cross_k"):
            return _view(flat, (rows, self.heads, self.dh, self._frames))
        return _view(flat, (rows, self.heads, self._frames, self.dh))

    def _source(self, j: int, pair: _Pair) -> np.ndarray:
        """Where the group's cross-attention input `j` is read from now."""
        return self._home[j] if self._on_home else pair.cur

    def _bind_cross(self, rows: int) -> None:
        for j, (name, pair) in enumerate(zip(self.cross_names, self._cross)):
            self._dec_io.bind_cpu_input(name, self._cross_view(self._source(j, pair), name, rows))

    # ------------------------------------------------------------------------------------ decoder
    def step(self, feed: Sequence[Sequence[int]], group: Group, into: int) -> np.ndarray:
        """Feed each row its tokens (left-padded to one length); returns the last position's
        logits (rows, V), written to logits buffer `into`."""
        b, p = group.rows, group.past
        io = self._dec_io
        t = self._inputs(feed, group, io)
        logits = self.logits(into, b)
        io.bind_output("logits", "cpu", 0, np.float32, logits.shape, _address(logits))
        for past, present, pair in zip(self.past_names, self.present_names, self._kv):
            io.bind_cpu_input(past, _view(pair.cur, (b, self.heads, p, self.dh)))
            out = _view(pair.other, (b, self.heads, p + t, self.dh))
            io.bind_output(present, "cpu", 0, np.float32, out.shape, _address(out))
        self.dec.run_with_iobinding(io)
        for pair in self._kv:
            pair.flip()
        group.past = p + t
        return logits

    def align(self, rows: Sequence[int], feed: Sequence[Sequence[int]]) -> np.ndarray:
        """The alignment heads' cross-attention scores (n, A, T, frames) of each of `feed`'s token
        sequences, read from position 0 (left-padded to one length T, as a prefill), against the
        encoded audio of the last group's request `rows[i]`: Whisper's forced alignment of a text
        to its audio. Valid until the next call; with `keep_encoded` only, once the group is decoded."""
        assert self.keep_encoded
        n = len(rows)
        io = self._align_io
        whole = list(rows) == list(range(self._encoded))  # every request of the group, in order: no copy
        for j, (name, pair) in enumerate(zip(self.cross_names, self._cross)):
            home = self._cross_view(self._home[j], name, self._encoded)
            io.bind_cpu_input(name, home if whole else np.take(home, rows, axis=0, out=self._cross_view(pair.other, name, n)))
        group = Group(rows=n)
        _view(self._count.cur, (n,))[:] = 0
        t = self._inputs(feed, group, io)
        for past, pair in zip(self.past_names, self._kv):
            io.bind_cpu_input(past, _view(pair.cur, (n, self.heads, 0, self.dh)))
        size = n * self.aligning * t * self._frames
        if self._scores.size < size:
            self._scores = np.empty(size, np.float32)
        scores = _view(self._scores, (n, self.aligning, t, self._frames))
        io.bind_output("alignment", "cpu", 0, np.float32, scores.shape, _address(scores))
        self.dec.run_with_iobinding(io)
        return scores

    def _inputs(self, feed: Sequence[Sequence[int]], group: Group, io) -> int:
        """Bind to `io` the tokens, positions and mask of feeding `feed` to `group` (each row
        left-padded to one length, which is returned); the group's counts and mask columns follow."""
        b, p = group.rows, group.past
        t = max(1, max(len(x) for x in feed))
        if t > self.n_ctx or p + t > self.cache_len:
            raise ValueError(f"{t} tokens on {p} cached columns: past the {self.n_ctx} positions and {self.cache_len} columns kept")
        tokens = _view(self._tokens, (b, t))
        positions = _view(self._positions, (b, t))
        mask = _view(self._mask, (b, 1, t, p + t))
        bias = _view(self._bias.cur, (b, self.cache_len))
        count = _view(self._count.cur, (b,))
        mask[:, 0, :, :p] = bias[:, None, :p]
        if t == 1 and all(feed):  # a decoding step: one token per row
            for r, x in enumerate(feed):
                tokens[r, 0] = x[0]
            positions[:, 0] = count
            mask[:, 0, 0, p] = 0.0
            bias[:, p] = 0.0
            count += 1
        else:  # a prefill: rows of different lengths, padded on the left
            for r, x in enumerate(feed):
                pad = t - len(x)
                tokens[r, :pad] = 0
                positions[r, :pad] = 0
                for c, token in enumerate(x):
                    tokens[r, pad + c] = token
                np.add(self._arange[: len(x)], count[r], out=positions[r, pad:])
                rows_mask = mask[r, 0, :, p:]
                rows_mask[:] = self._causal[:t, :t]
                rows_mask[:, :pad] = NEG  # padding is attended by nobody but itself
                np.fill_diagonal(rows_mask[:pad, :pad], 0.0)
                bias[r, p : p + pad] = NEG
                bias[r, p + pad : p + t] = 0.0
                count[r] += len(x)
        io.bind_cpu_input("tokens", tokens)
        io.bind_cpu_input("positions", positions)
        io.bind_cpu_input("mask", mask)
        return t

    def restart(self, group: Group) -> None:
        """Forget the group's decoded positions, keep its encoded audio: the next step's tokens
        start at position 0 with nothing before them to attend."""
        group.past = 0
        _view(self._count.cur, (group.rows,))[:] = 0

    def take(self, group: Group, keep: Sequence[int]) -> np.ndarray:
        """Keep (or repeat) the group's rows `keep`, in that order: caches, cross-attention, mask
        columns and counts move to their other side. Returns `keep` as an index array, valid
        until the next call."""
        b, n, p = group.rows, len(keep), group.past
        rows = self._taken[:n]
        for c, r in enumerate(keep):
            rows[c] = r
        kv = (self.heads, p, self.dh)
        for pair in self._kv:
            np.take(_view(pair.cur, (b, *kv)), rows, axis=0, out=_view(pair.other, (n, *kv)), mode="clip")
            pair.flip()
        for j, (name, pair) in enumerate(zip(self.cross_names, self._cross)):
            np.take(self._cross_view(self._source(j, pair), name, b), rows, axis=0, out=self._cross_view(pair.other, name, n),
                    mode="clip")
            pair.flip()
        self._on_home = False
        for pair, width in ((self._bias, self.cache_len), (self._count, 1)):
            np.take(_view(pair.cur, (b, width)), rows, axis=0, out=_view(pair.other, (n, width)), mode="clip")
            pair.flip()
        group.rows = n
        self._bind_cross(n)
        return rows

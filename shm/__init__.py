"""Per-stream audio rings in POSIX shared memory, written by ingest and read by workers."""

from shm.pool import PoolExhausted, RingPool, reclaim, segments
from shm.ring import SAMPLE_RATE, Ring, RingOverrun

__all__ = ["PoolExhausted", "Ring", "RingOverrun", "RingPool", "SAMPLE_RATE", "reclaim", "segments"]

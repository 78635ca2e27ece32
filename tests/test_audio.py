"""Decoding client PCM and resampling to 16 kHz."""

from __future__ import annotations

import io
import tracemalloc
import warnings

import numpy as np
import pytest
import soundfile

from ingest.audio import RATES, AudioFormatError, Resampler, buffer_len, decode_pcm
from protocol.messages import G711_SUBTYPES, MAX_F32_SAMPLE


def test_s16_is_scaled_to_unit_range() -> None:
    pcm = np.array([0, 16384, -32768, 32767], dtype="<i2")
    x = decode_pcm(pcm.tobytes(), "pcm_s16le", 1)
    assert x.dtype == np.float32
    np.testing.assert_allclose(x, [0.0, 0.5, -1.0, 32767 / 32768])


def test_channels_are_averaged() -> None:
    stereo = np.array([[1000, 3000], [-2000, 2000], [0, 32767]], dtype="<i2")
    x = decode_pcm(memoryview(stereo.tobytes()), "pcm_s16le", 2)
    np.testing.assert_allclose(x, [2000 / 32768, 0.0, 32767 / 65536], rtol=1e-6)
    quad = np.arange(12, dtype="<f4").reshape(3, 4) / 12
    np.testing.assert_allclose(decode_pcm(quad.tobytes(), "f32le", 4), quad.mean(axis=1), rtol=1e-6)


def test_mono_f32_is_a_view_of_the_payload() -> None:
    payload = np.linspace(-1, 1, 100, dtype="<f4").tobytes()
    x = decode_pcm(payload, "f32le", 1)
    assert x.dtype == np.float32 and not x.flags.owndata
    np.testing.assert_array_equal(x, np.linspace(-1, 1, 100, dtype=np.float32))


def test_frames_cost_no_array() -> None:
    """A stream's 16-bit and several-channel frames are converted into its kept buffer and mono
    32-bit float frames are viewed where they arrived: decoding a frame traces less than one
    frame's float32 array."""
    s16 = (np.arange(1600) - 800).astype("<i2").tobytes()
    f32 = np.linspace(-1, 1, 1600, dtype="<f4").tobytes()
    stereo = np.stack([np.arange(1600), -np.arange(1600) // 2], axis=1).astype("<i2")
    out = np.empty(4800, np.float32)
    decode_pcm(s16, "pcm_s16le", 1, out=out)
    decode_pcm(stereo.tobytes(), "pcm_s16le", 2, out=out)
    tracemalloc.start()
    try:
        for _ in range(20):
            x = decode_pcm(s16, "pcm_s16le", 1, out=out)
            y = decode_pcm(f32, "f32le", 1)
        for _ in range(20):
            z = decode_pcm(stereo.tobytes(), "pcm_s16le", 2, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1600 * 4 + len(stereo.tobytes()), f"decoding traced {peak} bytes at its peak"  # the test's own payload
    assert np.shares_memory(x, out) and np.shares_memory(z, out) and len(z) == 1600
    np.testing.assert_allclose(z, stereo.mean(axis=1) / 32768, rtol=1e-6)
    np.testing.assert_allclose(decode_pcm(s16, "pcm_s16le", 1, out=out), (np.arange(1600) - 800) / 32768)
    np.testing.assert_array_equal(y, np.linspace(-1, 1, 1600, dtype=np.float32))


@pytest.mark.parametrize(
    ("payload", "encoding", "channels"),
    [
        (b"\0" * 3, "pcm_s16le", 1),  # half a sample
        (b"\0" * 6, "pcm_s16le", 2),  # a frame and a half
        (b"\0" * 10, "f32le", 1),
        (b"\0" * 7, "pcm_mulaw", 2),  # three frames and a half
        (b"\0" * 5, "pcm_alaw", 4),
        (b"\0" * 8, "mp3", 1),
        (b"\0" * 8, "f32le", 0),
        (np.array([0.0, np.nan], dtype="<f4").tobytes(), "f32le", 1),
        (np.array([np.inf, 0.0], dtype="<f4").tobytes(), "f32le", 2),
        (np.array([0.5, -np.inf, 0.25], dtype="<f4").tobytes(), "f32le", 1),
        (np.array([3e38, 3e38, -3e38, -3e38], dtype="<f4").tobytes(), "f32le", 2),  # finite, but mixes down to inf
        (np.array([0.5, 3e38, -3e38], dtype="<f4").tobytes(), "f32le", 1),  # finite, but the resampler makes NaN
        (np.array([0.0, MAX_F32_SAMPLE * 1.01], dtype="<f4").tobytes(), "f32le", 1),
        (np.array([-MAX_F32_SAMPLE * 1.01, 0.0], dtype="<f4").tobytes(), "f32le", 2),
    ],
)
def test_malformed_audio_is_rejected(payload: bytes, encoding: str, channels: int) -> None:
    with pytest.raises(AudioFormatError):
        decode_pcm(payload, encoding, channels)


def test_f32_overshoot_within_the_bound_is_audio() -> None:
    x = np.array([[MAX_F32_SAMPLE, -MAX_F32_SAMPLE], [1.5, 2.5], [-3.0, -1.0]], dtype="<f4")
    np.testing.assert_allclose(decode_pcm(x.tobytes(), "f32le", 2), [0.0, 2.0, -2.0])
    np.testing.assert_array_equal(decode_pcm(x.tobytes(), "f32le", 1), x.reshape(-1))


def audioop_decoders() -> dict[str, object]:
    """The standard library's G.711 decoders, where this Python still has them (gone in 3.13)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    return {"pcm_mulaw": audioop.ulaw2lin, "pcm_alaw": audioop.alaw2lin}


@pytest.mark.parametrize("encoding", ["pcm_mulaw", "pcm_alaw"])
def test_g711_codes_decode_as_the_standard_library_does(encoding: str) -> None:
    """Every one of the 256 codes, on the scale 16-bit audio has."""
    codes = bytes(range(256))
    expected = np.frombuffer(audioop_decoders()[encoding](codes, 2), "<i2") / np.float32(32768)
    x = decode_pcm(codes, encoding, 1)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x, expected)


def test_g711_levels_of_the_standard() -> None:
    """Codes whose 16-bit levels G.711 itself fixes: silence, the smallest and the largest step
    (mu-law 0xFF is zero, 0x80/0x00 are ±32124; A-law 0xD5/0x55 are ±8, 0xAA/0x2A are ±32256)."""
    mulaw = decode_pcm(bytes([0xFF, 0x7F, 0x80, 0x00]), "pcm_mulaw", 1) * 32768
    np.testing.assert_array_equal(mulaw, [0, 0, 32124, -32124])
    alaw = decode_pcm(bytes([0xD5, 0x55, 0xAA, 0x2A]), "pcm_alaw", 1) * 32768
    np.testing.assert_array_equal(alaw, [8, -8, 32256, -32256])


@pytest.mark.parametrize("encoding", ["pcm_mulaw", "pcm_alaw"])
def test_g711_round_trips_16_bit_audio_within_its_step(encoding: str) -> None:
    """16-bit audio encoded by libsndfile comes back within G.711's step at its level (1/32 of
    full scale at the loudest, a few units of 16-bit audio near silence)."""
    s16 = (np.sin(np.linspace(0, 40 * np.pi, 8000)) * np.linspace(0, 32000, 8000)).astype("<i2")
    buf = io.BytesIO()
    soundfile.write(buf, s16, 8000, format="RAW", subtype=G711_SUBTYPES[encoding])
    x = decode_pcm(buf.getvalue(), encoding, 1) * 32768
    assert len(buf.getvalue()) == len(x) == len(s16)
    np.testing.assert_array_less(np.abs(x - s16), np.abs(s16) / 32 + 9)


@pytest.mark.parametrize("encoding", ["pcm_mulaw", "pcm_alaw"])
def test_g711_channels_are_averaged(encoding: str) -> None:
    codes = np.arange(256, dtype=np.uint8)
    levels = decode_pcm(codes.tobytes(), encoding, 1)
    for channels in (2, 3):
        lanes = np.stack([np.roll(codes, 7 * c) for c in range(channels)], axis=1)  # (256, channels) interleaved
        expected = np.stack([levels[lanes[:, c]] for c in range(channels)], axis=1).mean(axis=1)
        np.testing.assert_allclose(decode_pcm(lanes.tobytes(), encoding, channels), expected, rtol=1e-6, atol=1e-7)


def test_g711_payload_of_any_length_is_whole_mono_frames() -> None:
    """One byte a sample: any length is whole frames for one channel, odd bytes never are for two."""
    for n in (1, 7, 161, 1601):
        assert len(decode_pcm(b"\x55" * n, "pcm_alaw", 1)) == len(decode_pcm(b"\xff" * n, "pcm_mulaw", 1)) == n
    assert len(decode_pcm(b"\xff" * 1602, "pcm_mulaw", 2)) == 801
    with pytest.raises(AudioFormatError, match="1601 bytes is not a whole number of 2-channel pcm_mulaw frames"):
        decode_pcm(b"\xff" * 1601, "pcm_mulaw", 2)


def test_g711_frames_cost_no_array() -> None:
    """G.711 frames, mono and stereo, are looked up into the stream's kept buffer (its indices
    too): decoding a frame traces less than one frame's float32 array."""
    mono = bytes(range(256)) * 7  # 1792 frames
    stereo = bytes(range(255, -1, -1)) * 14
    out = np.empty(max(buffer_len(1792, 1, "pcm_mulaw"), buffer_len(1792, 2, "pcm_alaw")), np.float32)
    decode_pcm(mono, "pcm_mulaw", 1, out=out)
    decode_pcm(stereo, "pcm_alaw", 2, out=out)
    tracemalloc.start()
    try:
        for _ in range(20):
            x = decode_pcm(mono, "pcm_mulaw", 1, out=out)
        for _ in range(20):
            y = decode_pcm(stereo, "pcm_alaw", 2, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1792 * 4, f"decoding traced {peak} bytes at its peak"
    assert np.shares_memory(y, out) and len(y) == 1792
    np.testing.assert_array_equal(y, decode_pcm(stereo, "pcm_alaw", 2))
    assert np.shares_memory(x, out) and len(x) == 1792
    np.testing.assert_array_equal(decode_pcm(mono, "pcm_mulaw", 1, out=out), decode_pcm(mono, "pcm_mulaw", 1))


def test_empty_payload_is_empty_audio() -> None:
    assert len(decode_pcm(b"", "pcm_s16le", 2)) == 0


def test_16k_passes_through_without_copy() -> None:
    x = np.ones(320, dtype=np.float32)
    assert Resampler(16000).process(x) is x


def test_unsupported_rate() -> None:
    with pytest.raises(AudioFormatError):
        Resampler(11025)


@pytest.mark.parametrize("rate", [r for r in RATES if r != 16000])
def test_chunked_resampling_keeps_duration_and_pitch(rate: int) -> None:
    seconds, freq = 2.0, 440.0
    t = np.arange(int(seconds * rate)) / rate
    x = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    resampler = Resampler(rate)
    chunk = int(rate * 0.02) + 3  # odd sizes, like a network would deliver
    parts = [resampler.process(x[i : i + chunk]) for i in range(0, len(x), chunk)]
    parts.append(resampler.process(np.zeros(0, dtype=np.float32), last=True))
    y = np.concatenate(parts)
    assert y.dtype == np.float32
    assert abs(len(y) - seconds * 16000) <= 2
    spectrum = np.abs(np.fft.rfft(y[4000:-4000] * np.hanning(len(y) - 8000)))
    peak_hz = np.argmax(spectrum) * 16000 / (len(y) - 8000)
    assert abs(peak_hz - freq) < 2
    # The filter delay is compensated: the output is aligned with the input in time.
    ref = (0.5 * np.sin(2 * np.pi * freq * np.arange(len(y)) / 16000)).astype(np.float32)
    np.testing.assert_allclose(y[2000:-2000], ref[2000:-2000], atol=0.02)

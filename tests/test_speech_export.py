"""Weights reader, log-mel and ONNX export checked against CTranslate2 / faster-whisper."""

from __future__ import annotations

import os
import threading

import numpy as np
import onnx
import pytest

from config.settings import ModelConfig
from speech import loader
from speech.audio import load_audio
from speech.ct2 import CT2Model
from speech.export import ALLOWED_OPS, build_encoder
from speech.mel import N_FRAMES, LogMel, mel_filters
from streamasr.testdata import utterances

ENCODER_ATOL = 1e-3  # max |ours - CTranslate2| on encoder outputs of magnitude ~10 (measured 2e-5)
MEL_ATOL = 1e-4
TRT_FORBIDDEN = {"Loop", "If", "Scan", "STFT", "SequenceAt", "SequenceConstruct", "SplitToSequence", "ConcatFromSequence"}


@pytest.fixture(scope="module")
def tiny_files():
    return loader.resolve_model(ModelConfig(name="whisper-tiny.en"))


@pytest.fixture(scope="module")
def ct2_tiny(tiny_files):
    return CT2Model(tiny_files.model_bin)


@pytest.fixture(scope="module")
def speech_audio():
    utt = [u for u in utterances() if u.name.startswith("librivox/")]
    assert utt, "pocketsphinx-testdata is not installed"
    return load_audio(utt[0].path)


def test_ct2_reader(ct2_tiny):
    m = ct2_tiny
    assert m.spec == "WhisperSpec" and m.version == 6
    assert m.raw["decoder/embeddings/weight"].dtype == np.float16
    # the output projection is an alias of the token embedding
    assert m.aliases["decoder/projection/weight"] == "decoder/embeddings/weight"
    proj = m.get("decoder/projection/weight")
    assert proj.dtype == np.float32 and proj.shape == (51864, 384)
    np.testing.assert_array_equal(proj, m.raw["decoder/embeddings/weight"].astype(np.float32))
    assert int(m.raw["decoder/num_heads"]) == 6


def test_int8_dequantization(tmp_path):
    import struct

    w = np.array([[10, -20], [30, 40]], dtype=np.int8)
    scale = np.array([10.0, 20.0], dtype=np.float32)

    def s(x: str) -> bytes:
        return struct.pack("<H", len(x) + 1) + x.encode() + b"\0"

    def var(name: str, a: np.ndarray, tid: int) -> bytes:
        return s(name) + struct.pack("<B", a.ndim) + b"".join(struct.pack("<I", d) for d in a.shape) + struct.pack("<BI", tid, a.nbytes) + a.tobytes()

    blob = struct.pack("<I", 6) + s("WhisperSpec") + struct.pack("<II", 3, 2) + var("w/weight", w, 1) + var("w/weight_scale", scale, 0)
    blob += struct.pack("<I", 1) + s("alias/weight") + s("w/weight")
    path = tmp_path / "model.bin"
    path.write_bytes(blob)
    m = CT2Model(path)
    np.testing.assert_allclose(m.get("alias/weight"), [[1.0, -2.0], [1.5, 2.0]])


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_match_reference(n_mels):
    """Whisper's filterbanks are librosa's (16 kHz, n_fft 400; 80 bins, 128 for large-v3), which
    faster-whisper's copy of librosa's formula gives; and the bank is shaped like a Slaney one:
    every filter non-empty, peaks rising with the bin, each triangle's area 1 (in Hz, checked
    where it spans enough FFT bins for the sum to tell)."""
    from faster_whisper.feature_extractor import FeatureExtractor

    ours = mel_filters(n_mels)
    assert ours.shape == (n_mels, 201)
    np.testing.assert_allclose(ours, FeatureExtractor.get_mel_filters(16_000, 400, n_mels), atol=1e-6)
    peaks = ours.argmax(axis=1)
    assert np.all(ours.max(axis=1) > 0) and np.all(np.diff(peaks) >= 0) and peaks[-1] > peaks[0]
    wide = (ours > 0).sum(axis=1) >= 8
    assert wide.sum() >= 5
    np.testing.assert_allclose(ours[wide].sum(axis=1) * 40.0, 1.0, atol=0.02)  # 40 Hz between FFT bins


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_reference(speech_audio, n_mels):
    from faster_whisper.feature_extractor import FeatureExtractor

    audio = speech_audio
    ours = LogMel(n_mels)([audio])[0]
    assert ours.shape == (n_mels, N_FRAMES) and ours.dtype == np.float32
    ref = FeatureExtractor(feature_size=n_mels)(audio, padding=160 * N_FRAMES)  # audio + 30 s of zeros
    content = len(audio) // 160
    np.testing.assert_allclose(ours[:, :content], ref[:, :content], atol=MEL_ATOL)
    assert np.all(ours[:, content:] == 0.0)  # Whisper pads the mel itself with zeros


def test_log_mel_keeps_its_buffers_and_matches_the_reference_in_every_window(speech_audio):
    """A worker's extractor serves windows of every size from the same buffers, a batch at a time:
    each row matches the reference, whatever the calls before it left in the buffers."""
    from faster_whisper.feature_extractor import FeatureExtractor

    reference = FeatureExtractor(feature_size=80)
    extract = LogMel()
    cases = [
        (speech_audio, N_FRAMES),
        (speech_audio[:16_000], 300),  # a short window after the largest
        (speech_audio[:8_000], N_FRAMES),  # little audio in the full window after a lot
        (np.zeros(0, np.float32), 500),
    ]
    batch = [speech_audio[:n] for n in (32_000, 4_000, 24_000)]
    for audios, frames in [([a], f) for a, f in cases] + [(batch, 500), (batch[::-1], 500)]:
        ours = extract(audios, frames)
        assert ours.shape == (len(audios), 80, frames) and ours.dtype == np.float32
        for row, audio in zip(ours, audios):
            content = min(frames, len(audio) // 160)
            if content:
                ref = reference(audio, padding=160 * N_FRAMES)
                np.testing.assert_allclose(row[:, :content], ref[:, :content], atol=MEL_ATOL)
            assert np.all(row[:, content:] == 0.0)


def test_encoder_matches_ctranslate2(ct2_tiny, tiny_files, speech_audio):
    import ctranslate2
    import onnxruntime as ort

    mel = LogMel()([speech_audio])
    sess = ort.InferenceSession(build_encoder(ct2_tiny).SerializeToString(), providers=["CPUExecutionProvider"])
    ours = sess.run(["encoder_out"], {"mel": mel})[0]
    ct2 = ctranslate2.models.Whisper(str(tiny_files.dir), device="cpu", compute_type="float32")
    ref = np.array(ct2.encode(ctranslate2.StorageView.from_array(mel)))
    assert ours.shape == ref.shape == (1, 1500, 384)
    assert np.abs(ours - ref).max() < ENCODER_ATOL
    # dynamic batch and a shortened audio context (5 s -> 250 positions)
    short = np.concatenate([mel[:, :, :500], mel[:, :, :500]])
    out = sess.run(None, {"mel": short})
    assert out[0].shape == (2, 250, 384)
    assert out[1].shape == (2, 6, 64, 250) and out[2].shape == (2, 6, 250, 64)  # cross_k_0, cross_v_0


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_graphs_use_only_allowed_ops():
    d = loader.ensure_exported(ModelConfig(name="whisper-tiny.en", precision="fp32"))
    for name in ("encoder", "decoder"):
        ops = _ops(d / f"{name}.onnx")
        assert ops <= ALLOWED_OPS, ops - ALLOWED_OPS
        assert not ops & TRT_FORBIDDEN


def test_export_cache(tmp_path, capsys):
    cfg = ModelConfig(name="whisper-tiny.en", cache_dir=str(tmp_path))
    killed = loader._export_dir(cfg, loader.resolve_model(cfg))  # an export killed midway left its work
    killed = killed.with_name(f".{killed.name}.tmp-abc123")
    (killed / "encoder.onnx").parent.mkdir(parents=True)
    (killed / "encoder.onnx").write_bytes(b"half a graph")
    results: list = []
    # two exporters at once: the lock makes the second wait and then reuse the first one's graphs
    threads = [threading.Thread(target=lambda: results.append(loader.ensure_exported(cfg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    out = results[0]
    assert capsys.readouterr().err.count("first run") == 1  # exported once: the second exporter reused it
    assert (out / "encoder.onnx").exists() and (out / "decoder.onnx").exists() and (out / "meta.json").exists()
    assert out.is_relative_to(tmp_path / "onnx") and "v" in out.name and out.name.endswith("-fp32")
    mtime = (out / "decoder.onnx").stat().st_mtime_ns
    assert loader.ensure_exported(cfg) == out  # cache hit: nothing written again
    assert (out / "decoder.onnx").stat().st_mtime_ns == mtime
    assert "first run" not in capsys.readouterr().err
    assert not list((tmp_path / "onnx").glob(".*tmp*"))  # no temporary leftovers


@pytest.mark.base
def test_a_damaged_assembled_base_model_is_assembled_again(tmp_path):
    """whisper-base's model.bin is assembled from two packages into the cache. A copy damaged
    there (a disk fault) is not refused on every load: it is assembled again from the packages."""
    cfg = ModelConfig(name="whisper-base", cache_dir=str(tmp_path))
    path = loader.resolve_model(cfg).model_bin
    with open(path, "r+b") as fh:
        fh.seek(1 << 20)
        byte = fh.read(1)
        fh.seek(1 << 20)
        fh.write(bytes([byte[0] ^ 0xFF]))
    files = loader.resolve_model(cfg)
    assert loader.sha256_file(files.model_bin) == loader.BASE_SHA256


def test_sha256_mismatch_is_reported(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"not a model")
    with pytest.raises(loader.ModelError, match="sha256"):
        loader._verify(f, "0" * 64, tmp_path, "whisper-test")


def test_model_directory_by_path(tiny_files, tmp_path):
    files = loader.resolve_model(ModelConfig(name=str(tiny_files.dir), cache_dir=str(tmp_path)))
    assert files.sha256 == loader.TINY_EN_SHA256
    with pytest.raises(loader.ModelError, match="unknown model"):
        loader.resolve_model(ModelConfig(name=str(tmp_path / "nope")))


def test_loader_backends():
    from speech.backend import DecodeRequest
    from speech.null_backend import NullBackend

    b = loader.load_backend(ModelConfig(name="null", null_text="hi"))
    assert isinstance(b, NullBackend)
    r = b.transcribe_batch([DecodeRequest(audio=np.zeros(32000, np.float32))])[0]
    assert r.text == "hi" and r.segments[0].end == 2.0
    with pytest.raises(NotImplementedError, match="TensorRT"):
        loader.load_backend(ModelConfig(backend="tensorrt"))


def test_new_weights_at_a_model_directory_s_path_are_not_taken_for_the_old(tiny_files, tmp_path):
    """A model directory updated in place with weights of the same size and the same mtime (a
    fine-tune of the same architecture, copied with `cp -p`/`rsync -a`, or an image built with
    normalized timestamps): the service must load the new weights' graphs, not the old ones'."""
    model = tmp_path / "mine"
    model.mkdir()
    (model / "tokenizer.json").symlink_to(tiny_files.dir / "tokenizer.json")
    (model / "model.bin").write_bytes(b"weights, version 1")
    cfg = ModelConfig(name=str(model), cache_dir=str(tmp_path / "cache"))
    old = loader.resolve_model(cfg)
    mtime = (model / "model.bin").stat().st_mtime_ns
    (tmp_path / "new.bin").write_bytes(b"weights, version 2")
    os.utime(tmp_path / "new.bin", ns=(mtime, mtime))
    os.replace(tmp_path / "new.bin", model / "model.bin")
    new = loader.resolve_model(cfg)
    assert new.sha256 == loader.sha256_file(model / "model.bin") != old.sha256
    assert loader._export_dir(cfg, new) != loader._export_dir(cfg, old)

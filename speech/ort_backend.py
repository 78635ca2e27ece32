"""Whisper on ONNX Runtime (CPU): the exported graphs driven by speech.decoding."""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from config.settings import ModelConfig
from speech.backend import SAMPLE_RATE, Backend, DecodeRequest, DecodeResult
from speech.decoding import DecodeOptions, WhisperDecoder
from speech.loader import ensure_all_exported, resolve_model
from speech.tokenizer import WhisperTokenizer

log = logging.getLogger("streamasr.speech")


@functools.cache  # registered with ONNX Runtime's environment: once per process
def _share_one_arena() -> None:
    """One CPU arena for every session of the process instead of one per session. A worker runs
    four sessions (encoder and decoder, for finals and for partials) one at a time, and each
    arena kept what its largest run needed: shared, the workers hold ~80 MB less (tiny.en)."""
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg({}))


def session_options(cfg: ModelConfig) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, int(cfg.threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_cpu_mem_arena = bool(cfg.arena)
    if cfg.arena:
        _share_one_arena()
        so.add_session_config_entry("session.use_env_allocators", "1")
    so.log_severity_level = 3
    # no busy-waiting between ops: with several workers per core (or other processes) spinning
    # threads steal the CPU from the ones doing work (measured 30% slower on a loaded 2-core box)
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


class OrtWhisperBackend(Backend):
    """Finals on `precision`'s graphs; partials on `partial_precision`'s when that differs (int8
    partials with fp32 finals: partial decodes are most of the work and are re-done anyway)."""

    def __init__(self, cfg: ModelConfig, warmup: bool = True):
        self.cfg = cfg
        t0 = time.perf_counter()
        files = resolve_model(cfg)
        self.model_dir = files.dir
        self.graph_dir, *partial_graphs = ensure_all_exported(cfg)
        self.encoder, self.decoder = self._sessions(self.graph_dir)
        self.tokenizer = WhisperTokenizer(files.dir)
        self.dims = self._dims()
        self.decoding = self._decoding(self.encoder, self.decoder, cfg.word_times)
        self.partial_decoding = self.decoding
        self.name = f"{files.name}/{cfg.precision}/onnxruntime"
        if partial_graphs:  # partials have no word times: their graphs keep no encoded audio for them
            self.partial_decoding = self._decoding(*self._sessions(partial_graphs[0]), word_times=False)
            self.name += f" ({cfg.partials_precision} partials)"
        self.multilingual = self.tokenizer.multilingual
        if warmup:
            self.warmup()
        log.info("loaded %s in %.2f s", self.name, time.perf_counter() - t0)

    def _sessions(self, graph_dir: Path) -> tuple[ort.InferenceSession, ort.InferenceSession]:
        so = session_options(self.cfg)
        providers = ["CPUExecutionProvider"]
        return (ort.InferenceSession(str(graph_dir / "encoder.onnx"), so, providers=providers),
                ort.InferenceSession(str(graph_dir / "decoder.onnx"), so, providers=providers))

    def _decoding(self, encoder: ort.InferenceSession, decoder: ort.InferenceSession, word_times: bool) -> WhisperDecoder:
        cfg = self.cfg
        return WhisperDecoder(encoder, decoder, self.tokenizer, self.dims,
                              DecodeOptions(beam_size=max(1, int(cfg.beam_size)), partial_window=cfg.partial_window,
                                            quick_first_partial=cfg.quick_first_partial,
                                            temperature_increment=cfg.temperature_increment, best_of=cfg.best_of,
                                            word_times=word_times))

    def _dims(self) -> dict:
        path = self.graph_dir / "dims.json"
        if path.exists():
            return json.loads(path.read_text())
        enc_out = {o.name: o.shape for o in self.encoder.get_outputs()}
        dec_in = {i.name: i.shape for i in self.decoder.get_inputs()}
        n_dec = sum(1 for n in dec_in if n.startswith("past_k_"))
        heads = dec_in["past_k_0"][1]
        return {
            "d": enc_out["encoder_out"][2], "n_dec": n_dec, "dec_heads": heads,
            "vocab": self.decoder.get_outputs()[0].shape[1], "n_mels": self.encoder.get_inputs()[0].shape[1],
        }  # fmt: skip

    def warmup(self) -> None:
        """One dummy decode of each window kind so the first real request is not slow."""
        audio = np.zeros(SAMPLE_RATE, dtype=np.float32)
        self.transcribe_batch([DecodeRequest(audio=audio, language="en"), DecodeRequest(audio=audio, language="en", partial=True)])

    def transcribe_batch(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        if not requests:
            return []
        if self.partial_decoding is self.decoding:
            return self.decoding.decode(requests)
        results: list[DecodeResult | None] = [None] * len(requests)
        for decoding, partial in ((self.decoding, False), (self.partial_decoding, True)):
            idx = [i for i, r in enumerate(requests) if r.partial == partial]
            if idx:
                for i, res in zip(idx, decoding.decode([requests[i] for i in idx])):
                    results[i] = res
        return results  # type: ignore[return-value]

    def transcribe_tokens(
        self, requests: Sequence[DecodeRequest], prompt_tokens: Sequence[list[int] | None]
    ) -> list[tuple[DecodeResult, list[int]]]:
        """Results plus decoded token ids, with Whisper's rule for the temperature fallback;
        prompts given as token ids (used by speech.longform)."""
        return self.decoding.decode_tokens(requests, prompt_tokens, whisper_rule=True)

    def close(self) -> None:
        self.encoder = self.decoder = None  # type: ignore[assignment]
        self.decoding = self.partial_decoding = None  # type: ignore[assignment]

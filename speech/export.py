"""Build ONNX graphs of Whisper from CTranslate2 weights, with the `onnx` package only.

Two graphs (opset 17), both with a dynamic batch dimension:

* ``encoder.onnx``: ``mel`` (B, n_mels, T) -> ``encoder_out`` (B, T/2, d) and, for every decoder
  layer i, the cross-attention keys ``cross_k_i`` (B, H, Dh, T/2) (already transposed for
  q @ k) and values ``cross_v_i`` (B, H, T/2, Dh). T is dynamic: the positional embedding is
  sliced to T/2 frames, so a partial decode can encode a shortened audio context.
* ``decoder.onnx``: ``tokens`` (B, T) int64, ``positions`` (B, T) int64, ``mask`` (B, 1, T, P+T)
  additive float32, ``past_k_i``/``past_v_i`` (B, H, P, Dh), ``cross_k_i``/``cross_v_i`` ->
  ``logits`` (B, V) of the last position, ``present_k_i``/``present_v_i`` (B, H, P+T, Dh) and
  ``alignment`` (B, A, T, frames): the cross-attention scores (before the softmax) of the
  model's A alignment heads, the heads whose attention follows the speech, from which
  `speech.words` times each word of a final. A decoding step leaves that output unbound.
  Positions and the mask come from the caller, so rows of a batch may hold prompts of
  different lengths (padding columns are masked) and T > 1 prefills a prompt in one call.

Cross K/V are encoder outputs (not a third graph): one call per batch, and the per-layer
tensors are fed straight to every decoder step without a slice/copy per step.

Operators used (all parsed by TensorRT 10's ONNX parser): see `ALLOWED_OPS`.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from speech.ct2 import CT2Model

OPSET = 17
EXPORTER_VERSION = 4
ALLOWED_OPS = frozenset(
    {
        "Add", "Concat", "Conv", "Div", "Erf", "Gather", "LayerNormalization", "MatMul", "Mul",
        "Reshape", "Shape", "Slice", "Softmax", "Split", "Squeeze", "Transpose", "Unsqueeze",
    }
)  # fmt: skip
LN_EPS = 1e-5


class _Graph:
    def __init__(self, prefix: str = ""):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0
        self._consts: dict[tuple, str] = {}

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def init(self, name: str, arr: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def const(self, values, dtype=np.int64) -> str:
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(self.name("const"), arr)
        return self._consts[key]

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, n_out: int = 1, out=None, **attrs):
        outs = out if out is not None else [self.name(hint or op_type.lower()) for _ in range(n_out)]
        if isinstance(outs, str):
            outs = [outs]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name("n_" + op_type), **attrs))
        return outs[0] if len(outs) == 1 else outs

    # building blocks -------------------------------------------------------------------------
    def linear(self, x: str, w: np.ndarray, b: np.ndarray | None, name: str) -> str:
        """x @ w.T + b with a CTranslate2 (out, in) weight."""
        y = self.op("MatMul", [x, self.init(name + ".weight", w.T.astype(np.float32))])
        if b is not None and np.any(b):
            y = self.op("Add", [y, self.init(name + ".bias", b.astype(np.float32))])
        return y

    def layer_norm(self, x: str, m: CT2Model, scope: str) -> str:
        g = self.init(scope + ".gamma", m.get(scope + "/gamma"))
        b = self.init(scope + ".beta", m.get(scope + "/beta"))
        return self.op("LayerNormalization", [x, g, b], axis=-1, epsilon=LN_EPS)

    def gelu(self, x: str) -> str:
        e = self.op("Erf", [self.op("Div", [x, self.const(np.sqrt(2.0), np.float32)])])
        return self.op("Mul", [self.op("Mul", [x, self.op("Add", [e, self.const(1.0, np.float32)])]),
                               self.const(0.5, np.float32)])  # fmt: skip

    def heads(self, x: str, h: int, dh: int, perm: list[int]) -> str:
        """(B, T, H*Dh) -> transposed (B, T, H, Dh) by `perm`."""
        r = self.op("Reshape", [x, self.const([0, -1, h, dh])])
        return self.op("Transpose", [r], perm=perm)

    def merge_heads(self, x: str, d: int) -> str:
        t = self.op("Transpose", [x], perm=[0, 2, 1, 3])
        return self.op("Reshape", [t, self.const([0, -1, d])])

    def ffn(self, x: str, m: CT2Model, scope: str) -> str:
        h = self.layer_norm(x, m, scope + "/layer_norm")
        h = self.linear(h, m.get(scope + "/linear_0/weight"), m.get(scope + "/linear_0/bias"), scope + ".fc1")
        h = self.gelu(h)
        h = self.linear(h, m.get(scope + "/linear_1/weight"), m.get(scope + "/linear_1/bias"), scope + ".fc2")
        return self.op("Add", [x, h])


def _dims(m: CT2Model) -> dict[str, int]:
    d = m.raw["encoder/conv1/weight"].shape[0]
    enc_h = int(m.raw["encoder/num_heads"]) if "encoder/num_heads" in m.raw else max(1, d // 64)
    dec_h = int(m.raw["decoder/num_heads"]) if "decoder/num_heads" in m.raw else enc_h
    n_enc = len({k.split("/")[1] for k in m.raw if re.match(r"encoder/layer_\d+/", k)})
    n_dec = len({k.split("/")[1] for k in m.raw if re.match(r"decoder/layer_\d+/", k)})
    vocab, _ = m.raw["decoder/embeddings/weight"].shape
    n_ctx_audio = m.raw["encoder/position_encodings/encodings"].shape[0]
    n_ctx_text = m.raw["decoder/position_encodings/encodings"].shape[0]
    n_mels = m.raw["encoder/conv1/weight"].shape[1]
    return dict(d=d, enc_heads=enc_h, dec_heads=dec_h, n_enc=n_enc, n_dec=n_dec, vocab=vocab,
                n_audio_ctx=n_ctx_audio, n_text_ctx=n_ctx_text, n_mels=n_mels)  # fmt: skip


def model_dims(m: CT2Model) -> dict[str, int]:
    if m.spec and m.spec != "WhisperSpec":
        raise ValueError(f"{m.path}: a {m.spec} model, not Whisper")
    return _dims(m)


def _self_attention_qkv(g: _Graph, x: str, m: CT2Model, scope: str, d: int, dh: int) -> tuple[str, str, str]:
    w = m.get(scope + "/linear_0/weight").copy()  # (3d, d): q, k, v
    b = m.get(scope + "/linear_0/bias").copy()
    scale = 1.0 / np.sqrt(dh)
    w[:d] *= scale
    b[:d] *= scale
    qkv = g.linear(x, w, b, scope + ".qkv")
    return g.op("Split", [qkv, g.const([d, d, d])], n_out=3, axis=-1)


def build_encoder(m: CT2Model) -> onnx.ModelProto:
    dm = model_dims(m)
    d, h, L = dm["d"], dm["enc_heads"], dm["n_enc"]
    dh = d // h
    g = _Graph()
    x = "mel"
    c1 = g.op("Conv", [x, g.init("conv1.weight", m.get("encoder/conv1/weight")), g.init("conv1.bias", m.get("encoder/conv1/bias"))],
              kernel_shape=[3], pads=[1, 1], strides=[1])  # fmt: skip
    c1 = g.gelu(c1)
    c2 = g.op("Conv", [c1, g.init("conv2.weight", m.get("encoder/conv2/weight")), g.init("conv2.bias", m.get("encoder/conv2/bias"))],
              kernel_shape=[3], pads=[1, 1], strides=[2])  # fmt: skip
    c2 = g.gelu(c2)  # (B, d, T/2)
    n_frames = g.op("Slice", [g.op("Shape", [c2]), g.const([2]), g.const([3]), g.const([0])])
    pos = g.op("Slice", [g.init("encoder.positions", m.get("encoder/position_encodings/encodings")),
                         g.const([0]), n_frames, g.const([0])])  # fmt: skip
    x = g.op("Add", [g.op("Transpose", [c2], perm=[0, 2, 1]), pos])
    for i in range(L):
        s = f"encoder/layer_{i}"
        a = g.layer_norm(x, m, s + "/self_attention/layer_norm")
        q, k, v = _self_attention_qkv(g, a, m, s + "/self_attention", d, dh)
        q = g.heads(q, h, dh, [0, 2, 1, 3])
        k = g.heads(k, h, dh, [0, 2, 3, 1])
        v = g.heads(v, h, dh, [0, 2, 1, 3])
        p = g.op("Softmax", [g.op("MatMul", [q, k])], axis=-1)
        o = g.merge_heads(g.op("MatMul", [p, v]), d)
        o = g.linear(o, m.get(s + "/self_attention/linear_1/weight"), m.get(s + "/self_attention/linear_1/bias"), s + ".out")
        x = g.op("Add", [x, o])
        x = g.ffn(x, m, s + "/ffn")
    g.layer_norm(x, m, "encoder/layer_norm")
    g.nodes[-1].output[0] = enc = "encoder_out"  # the final layer norm's output is the graph's output
    outputs = [helper.make_tensor_value_info(enc, TensorProto.FLOAT, ["batch", "frames", d])]
    hd = dm["dec_heads"]
    dhd = d // hd
    for i in range(dm["n_dec"]):
        s = f"decoder/layer_{i}/attention"
        kv = g.linear(enc, m.get(s + "/linear_1/weight"), m.get(s + "/linear_1/bias"), f"decoder.{i}.cross_kv")
        k, v = g.op("Split", [kv, g.const([d, d])], n_out=2, axis=-1)
        g.op("Transpose", [g.op("Reshape", [k, g.const([0, -1, hd, dhd])])], perm=[0, 2, 3, 1], out=f"cross_k_{i}")
        g.op("Transpose", [g.op("Reshape", [v, g.const([0, -1, hd, dhd])])], perm=[0, 2, 1, 3], out=f"cross_v_{i}")
        outputs.append(helper.make_tensor_value_info(f"cross_k_{i}", TensorProto.FLOAT, ["batch", hd, dhd, "frames"]))
        outputs.append(helper.make_tensor_value_info(f"cross_v_{i}", TensorProto.FLOAT, ["batch", hd, "frames", dhd]))
    inputs = [helper.make_tensor_value_info("mel", TensorProto.FLOAT, ["batch", dm["n_mels"], "mel_frames"])]
    graph = helper.make_graph(g.nodes, "whisper_encoder", inputs, outputs, g.inits)
    return _model(graph)


def alignment_heads(config: dict, dims: dict[str, int]) -> list[list[int]]:
    """The model's alignment heads, [layer, head] each: those its `config.json` names (CTranslate2
    writes Whisper's table there), else every head of the decoder's second half, as Whisper does
    for a model it has no table for."""
    given = config.get("alignment_heads")
    if given and all(0 <= layer < dims["n_dec"] and 0 <= head < dims["dec_heads"] for layer, head in given):
        return [[int(layer), int(head)] for layer, head in given]
    return [[layer, head] for layer in range(dims["n_dec"] // 2, dims["n_dec"]) for head in range(dims["dec_heads"])]


def build_decoder(m: CT2Model, heads: list[list[int]]) -> onnx.ModelProto:
    """The decoder; `heads` ([layer, head] each) are the alignment heads its `alignment` output gives."""
    dm = model_dims(m)
    d, h, L = dm["d"], dm["dec_heads"], dm["n_dec"]
    dh = d // h
    g = _Graph()
    emb = m.get("decoder/embeddings/weight")
    proj = m.get("decoder/projection/weight") if "decoder/projection/weight" in m else emb
    x = g.op("Gather", [g.init("decoder.embeddings", emb), "tokens"], axis=0)
    p = g.op("Gather", [g.init("decoder.positions", m.get("decoder/position_encodings/encodings")), "positions"], axis=0)
    x = g.op("Add", [x, p])
    scale = 1.0 / np.sqrt(dh)
    inputs = [
        helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "tokens"]),
        helper.make_tensor_value_info("positions", TensorProto.INT64, ["batch", "tokens"]),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 1, "tokens", "total"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", dm["vocab"]])]
    for i in range(L):
        inputs.append(helper.make_tensor_value_info(f"past_k_{i}", TensorProto.FLOAT, ["batch", h, "past", dh]))
        inputs.append(helper.make_tensor_value_info(f"past_v_{i}", TensorProto.FLOAT, ["batch", h, "past", dh]))
    for i in range(L):
        inputs.append(helper.make_tensor_value_info(f"cross_k_{i}", TensorProto.FLOAT, ["batch", h, dh, "frames"]))
        inputs.append(helper.make_tensor_value_info(f"cross_v_{i}", TensorProto.FLOAT, ["batch", h, "frames", dh]))
    aligning: list[str] = []  # each layer's alignment heads' cross-attention scores
    for i in range(L):
        s = f"decoder/layer_{i}"
        a = g.layer_norm(x, m, s + "/self_attention/layer_norm")
        q, k, v = _self_attention_qkv(g, a, m, s + "/self_attention", d, dh)
        q = g.heads(q, h, dh, [0, 2, 1, 3])
        k = g.heads(k, h, dh, [0, 2, 1, 3])
        v = g.heads(v, h, dh, [0, 2, 1, 3])
        kk = g.op("Concat", [f"past_k_{i}", k], axis=2, out=f"present_k_{i}")
        vv = g.op("Concat", [f"past_v_{i}", v], axis=2, out=f"present_v_{i}")
        outputs.append(helper.make_tensor_value_info(f"present_k_{i}", TensorProto.FLOAT, ["batch", h, "total", dh]))
        outputs.append(helper.make_tensor_value_info(f"present_v_{i}", TensorProto.FLOAT, ["batch", h, "total", dh]))
        sc = g.op("Add", [g.op("MatMul", [q, g.op("Transpose", [kk], perm=[0, 1, 3, 2])]), "mask"])
        o = g.merge_heads(g.op("MatMul", [g.op("Softmax", [sc], axis=-1), vv]), d)
        o = g.linear(o, m.get(s + "/self_attention/linear_1/weight"), m.get(s + "/self_attention/linear_1/bias"), s + ".self_out")
        x = g.op("Add", [x, o])
        # cross attention
        c = s + "/attention"
        a = g.layer_norm(x, m, c + "/layer_norm")
        q = g.linear(a, m.get(c + "/linear_0/weight") * scale, m.get(c + "/linear_0/bias") * scale, s + ".cross_q")
        q = g.heads(q, h, dh, [0, 2, 1, 3])
        scores = g.op("MatMul", [q, f"cross_k_{i}"])
        if mine := [head for layer, head in heads if layer == i]:
            aligning.append(g.op("Gather", [scores, g.const(mine)], axis=1))
        pr = g.op("Softmax", [scores], axis=-1)
        o = g.merge_heads(g.op("MatMul", [pr, f"cross_v_{i}"]), d)
        o = g.linear(o, m.get(c + "/linear_2/weight"), m.get(c + "/linear_2/bias"), s + ".cross_out")
        x = g.op("Add", [x, o])
        x = g.ffn(x, m, s + "/ffn")
    g.op("Concat", aligning, axis=1, out="alignment")
    outputs.append(helper.make_tensor_value_info("alignment", TensorProto.FLOAT, ["batch", len(heads), "tokens", "frames"]))
    last = g.op("Slice", [x, g.const([-1]), g.const([np.iinfo(np.int64).max]), g.const([1])])
    last = g.op("Squeeze", [last, g.const([1])])
    last = g.layer_norm(last, m, "decoder/layer_norm")
    g.op("MatMul", [last, g.init("decoder.projection", proj.T.astype(np.float32))], out="logits")
    graph = helper.make_graph(g.nodes, "whisper_decoder", inputs, outputs, g.inits)
    return _model(graph)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="streamasr")
    model.ir_version = 8
    return model


def graph_ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def check_ops(model: onnx.ModelProto) -> None:
    bad = graph_ops(model) - ALLOWED_OPS
    if bad:
        raise ValueError(f"graph uses operators outside the allowed set: {sorted(bad)}")

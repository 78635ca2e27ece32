"""Silero VAD's graph, rewritten so that a batch of streams costs a third as much per chunk.

Silero v5 ships one graph for 8 and 16 kHz: the whole model sits inside an `If` on `sr`, and
its 1-D convolutions each see 1–4 frames of a chunk. ONNX Runtime runs such a convolution as a
small matrix product per batch row, with as many columns as frames, so a batch of 200 chunks
cost as much per chunk as a batch of 8. Here the 16 kHz branch becomes the graph, and each
convolution becomes one matrix product over the whole batch: the time slices its taps read are
concatenated into rows of (batch × frames) and multiplied by the kernel laid out as a matrix.
The `If`s inside, on shapes a chunk fixes, are replaced by the branches they take.

The graph also takes several consecutive chunks of a stream in one call. Silero runs each chunk
through a convolutional front end and then one step of an LSTM; only the LSTM carries anything
from one chunk to the next. So every chunk of a call goes through the front end as one batch,
the LSTM runs each stream's chunks as a sequence (its `sequence_lens` are the streams' chunk
counts), and the decoder reads every step's output. A stream that sends 100 ms frames has three
chunks to classify per frame: one call instead of three calls one after another.

The weights and every other node are Silero's; outputs agree with the shipped graph's, run a
chunk at a time, to float rounding (tests/test_vad.py).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper


class UnexpectedGraph(RuntimeError):
    """The installed Silero graph is not laid out as the rewrite expects (a new release)."""


def batched_graph(path: Path, rate: int, frame: int, state: int) -> bytes:
    """The serialized graph for `rate` with convolutions as batch-wide matrix products, over
    sequences of chunks.

    Inputs: `input` (N, frame), the N chunks of a call, each stream's together and in order, each
    behind the samples of the stream before it; `state` (2, B, state) of the call's B streams;
    `lengths` (B,) int32, their chunk counts; with L the largest, `slots` (B * L,) int64, the
    chunk at each stream's step (any chunk where a stream has fewer), and `rows` (N,) int64, each
    chunk's place in those steps. Outputs `output` (N, 1) and `stateN` (2, B, state), each
    stream's state after its last chunk.
    """
    model = _inline_fixed_branches(_one_rate(onnx.load(str(path)), rate), frame, state)
    lengths = _conv_input_lengths(model, frame, state)
    weights = _constants(model.graph)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type == "Conv" and _kernel(node) > 1:
            nodes.extend(_conv_as_matmul(node, weights, lengths[node.output[0]]))
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(_without_unused_constants(nodes, [o.name for o in model.graph.output]))
    _over_sequences(model)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _over_sequences(model: onnx.ModelProto) -> None:
    """Feed the LSTM every stream's chunks as one sequence, and the decoder every step's output.

    Before: the front end's features (B, H) -> Unsqueeze -> LSTM (one step) -> last hidden state
    -> decoder, and -> `stateN`. After: features (N, H) -> Gather `slots` -> (B, L, H) -> (L, B, H)
    -> LSTM over `lengths` steps; its output (L, 1, B, H) -> (B * L, H) -> Gather `rows` -> (N, H)
    -> decoder. The last hidden and cell states still make `stateN`.
    """
    graph = model.graph
    lstms = [node for node in graph.node if node.op_type == "LSTM"]
    if len(lstms) != 1:
        raise UnexpectedGraph(f"expected one LSTM, found {len(lstms)}")
    lstm = lstms[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in lstm.attribute}
    if attrs.get("direction", b"forward") not in (b"forward", "forward") or attrs.get("layout", 0) != 0 \
            or len(lstm.input) < 7 or lstm.input[4] or len(lstm.output) < 2:
        raise UnexpectedGraph("expected a forward LSTM, sequence first, with initial states and no sequence lengths")
    hidden = int(attrs["hidden_size"])
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in _reads(node):
            readers[name].append(node)
    step = producer.get(lstm.input[0])
    if step is None or step.op_type != "Unsqueeze" or len(readers[step.output[0]]) != 1:
        raise UnexpectedGraph("expected the LSTM's input to be the features with a time axis added")
    decoder, hidden_in = _decoder_entry(lstm.output[1], readers, [o.name for o in graph.output])

    made: list[onnx.NodeProto] = []

    def const(name: str, value: list[int]) -> str:
        made.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.int64), name)))
        return name

    def add(op: str, inputs: list[str], output: str, **kw: object) -> str:
        made.append(helper.make_node(op, inputs, [output], **kw))
        return output

    streams = add("Slice", [add("Shape", ["state"], "seq/state_shape"), const("seq/one", [1]), const("seq/two", [2])], "seq/streams")
    by_stream = add("Concat", [streams, const("seq/steps_hidden", [-1, hidden])], "seq/by_stream", axis=0)
    steps = add("Gather", [step.input[0], "slots"], "seq/steps", axis=0)  # (B * L, H)
    sequences = add("Transpose", [add("Reshape", [steps, by_stream], "seq/per_stream")], "seq/time_first", perm=[1, 0, 2])
    outputs = add("Transpose", [add("Squeeze", [lstm.output[0], const("seq/direction", [1])], "seq/outputs")], "seq/stream_first",
                  perm=[1, 0, 2])  # (B, L, H)
    flat = add("Reshape", [outputs, const("seq/rows_hidden", [-1, hidden])], "seq/flat")
    per_chunk = add("Gather", [flat, "rows"], "seq/per_chunk", axis=0)  # (N, H), as the features were
    decoder.input[list(decoder.input).index(hidden_in)] = per_chunk
    lstm.input[0], lstm.input[4] = sequences, "lengths"
    nodes = [node for node in graph.node if node is not step]
    del graph.node[:]
    graph.node.extend(_topological(_without_unused_constants(made + nodes, [o.name for o in graph.output])))
    int64 = onnx.TensorProto.INT64
    graph.input.extend([helper.make_tensor_value_info("lengths", onnx.TensorProto.INT32, ["streams"]),
                        helper.make_tensor_value_info("slots", int64, ["steps"]),
                        helper.make_tensor_value_info("rows", int64, ["chunks"])])


def _decoder_entry(hidden: str, readers: dict[str, list[onnx.NodeProto]], outputs: list[str]) -> tuple[onnx.NodeProto, str]:
    """The node where the LSTM's last hidden state enters the decoder, and the name it reads it
    by: past the Squeeze and Identity nodes that pass it on, the one reader from which `output`
    is reached but not `stateN`."""
    name = hidden
    while len(readers[name]) == 1 and readers[name][0].op_type in ("Squeeze", "Identity"):
        name = readers[name][0].output[0]
    reach = {node.name or id(node): _reaches(node, readers) for node in readers[name]}
    entries = [node for node in readers[name] if reach[node.name or id(node)] & set(outputs) == {"output"}]
    if len(entries) != 1 or not any("stateN" in r for r in reach.values()):
        raise UnexpectedGraph("expected the LSTM's hidden state to feed the decoder and stateN apart")
    return entries[0], name


def _reaches(node: onnx.NodeProto, readers: dict[str, list[onnx.NodeProto]]) -> set[str]:
    """Every tensor name downstream of `node`."""
    seen: set[str] = set()
    todo = list(node.output)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for reader in readers[name]:
            todo.extend(reader.output)
    return seen


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` ordered so that each comes after what it reads (ONNX requires it)."""
    made = {out for node in nodes for out in node.output}
    done: set[str] = set()
    ordered: list[onnx.NodeProto] = []
    waiting = list(nodes)
    while waiting:
        ready = [node for node in waiting if all(name in done or name not in made for name in _reads(node))]
        if not ready:
            raise UnexpectedGraph("the rewritten graph has a cycle")
        ids = {id(node) for node in ready}
        waiting = [node for node in waiting if id(node) not in ids]
        ordered.extend(ready)
        done.update(out for node in ready for out in node.output)
    return ordered


def _one_rate(model: onnx.ModelProto, rate: int) -> onnx.ModelProto:
    """The branch of the top-level `If` taken when `sr` is `rate`, as a graph without `sr`."""
    graph = model.graph
    consts = _constants(graph)
    branches = [node for node in graph.node if node.op_type == "If"]
    equal = [node for node in graph.node if node.op_type == "Equal" and "sr" in node.input]
    if len(branches) != 1 or len(equal) != 1 or branches[0].input[0] != equal[0].output[0]:
        raise UnexpectedGraph("expected the model inside one If on sr == rate")
    other = [name for name in equal[0].input if name != "sr"]
    if len(other) != 1 or other[0] not in consts or int(consts[other[0]]) != rate:
        raise UnexpectedGraph(f"expected the If to test sr == {rate}")
    branch = next(attr.g for attr in branches[0].attribute if attr.name == "then_branch")
    outputs = {node.input[0]: node.output[0] for node in graph.node if node.op_type == "Identity"}
    results = [helper.make_node("Identity", [inner.name], [outputs.get(outer, outer)])
               for inner, outer in zip(branch.output, branches[0].output)]
    inputs = [value for value in graph.input if value.name != "sr"]
    body = helper.make_graph([*branch.node, *results], f"silero_vad_{rate}", inputs, list(graph.output))
    return helper.make_model(body, opset_imports=model.opset_import, ir_version=model.ir_version)


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    return {node.output[0]: numpy_helper.to_array(node.attribute[0].t) for node in graph.node
            if node.op_type == "Constant" and node.attribute[0].name == "value"}


def _kernel(node: onnx.NodeProto) -> int:
    return int(helper.get_attribute_value(next(a for a in node.attribute if a.name == "kernel_shape"))[0])


def _probe(model: onnx.ModelProto, names: list[str], frame: int, state: int, batch: int, noise: bool = False) -> list[np.ndarray]:
    """The values `names` take when the graph runs once on a batch of silent chunks (or noise)."""
    rng = np.random.default_rng(0)
    feed = {"input": np.zeros((batch, frame), np.float32), "state": np.zeros((2, batch, state), np.float32)}
    if noise:
        feed = {name: rng.standard_normal(x.shape).astype(np.float32) * 0.1 for name, x in feed.items()}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _inline_fixed_branches(model: onnx.ModelProto, frame: int, state: int) -> onnx.ModelProto:
    """Each `If` whose condition comes out the same for any batch becomes the branch it takes.

    Silero's `If`s test shapes (is there a state, is a length 1), and these are fixed once the
    chunk size is. ONNX Runtime runs each branch as a subgraph of its own, a fixed cost per call
    that weighs most on small batches; inlined, its nodes join the graph's optimizations.
    Conditions are read from two runs, silence at batch 1 and noise at batch 3, so one that
    depends on the batch or the audio stays.
    """
    while True:
        branches = [node for node in model.graph.node if node.op_type == "If"]
        if not branches:
            return model
        conditions = [node.input[0] for node in branches]
        one, three = _probe(model, conditions, frame, state, 1), _probe(model, conditions, frame, state, 3, noise=True)
        taken = {id(node): bool(a) for node, a, b in zip(branches, one, three) if bool(a) == bool(b)}
        if not taken:
            return model
        names = {name for node in model.graph.node for name in node.output}
        nodes: list[onnx.NodeProto] = []
        for node in model.graph.node:
            if id(node) not in taken:
                nodes.append(node)
                continue
            branch = next(attr.g for attr in node.attribute if attr.name == ("then_branch" if taken[id(node)] else "else_branch"))
            made = {name for inner in branch.node for name in inner.output}
            if made & names:
                raise UnexpectedGraph(f"a branch of {node.name} reuses names of the graph around it")
            names |= made
            nodes.extend(branch.node)
            nodes.extend(helper.make_node("Identity", [inner.name], [outer]) for inner, outer in zip(branch.output, node.output))
        del model.graph.node[:]
        model.graph.node.extend(_without_unused_constants(nodes, [o.name for o in model.graph.output]))


def _conv_input_lengths(model: onnx.ModelProto, frame: int, state: int) -> dict[str, int]:
    """Frames each convolution reads, keyed by its output: fixed, since a chunk's input is.

    Found by running the graph once with the convolutions' inputs as extra outputs, which holds
    whatever shape arithmetic the graph does before them.
    """
    convs = [node for node in model.graph.node if node.op_type == "Conv"]
    shapes = _probe(model, [node.input[0] for node in convs], frame, state, 1)
    return {node.output[0]: shape.shape[-1] for node, shape in zip(convs, shapes)}


def _conv_as_matmul(node: onnx.NodeProto, weights: dict[str, np.ndarray], length: int) -> list[onnx.NodeProto]:
    """One Conv (B, C, T) -> (B, F, T') as Transpose, Pad, one Slice per tap, Concat, MatMul.

    A single-channel convolution whose stride divides its kernel and the padded length (the
    STFT: 256 samples every 128) is first cut into blocks of `stride` samples, which makes it a
    stride-1 convolution over the blocks with `kernel / stride` taps: two slices, not 256.
    """
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("group", 1) != 1 or any(d != 1 for d in attrs.get("dilations", [1])) or node.input[1] not in weights:
        raise UnexpectedGraph(f"convolution {node.name} is not a plain 1-D convolution with constant weights")
    w = weights[node.input[1]]
    out_ch, in_ch, kernel = w.shape
    before, after = attrs.get("pads", [0, 0])
    stride = attrs.get("strides", [1])[0]
    padded = length + before + after
    frames = (padded - kernel) // stride + 1
    name = f"{node.name}/matmul"
    made: list[onnx.NodeProto] = []

    def const(suffix: str, value: np.ndarray | list[int]) -> str:
        array = np.asarray(value, dtype=np.int64) if isinstance(value, list) else value
        made.append(helper.make_node("Constant", [], [name + suffix], value=numpy_helper.from_array(array, name + suffix)))
        return name + suffix

    def add(op: str, inputs: list[str], suffix: str, **kw: object) -> str:
        made.append(helper.make_node(op, inputs, [name + suffix], **kw))
        return name + suffix

    x = add("Transpose", [node.input[0]], "/time_major", perm=[0, 2, 1])  # (B, T, C)
    if before or after:
        x = add("Pad", [x, const("/pads", [0, before, 0, 0, after, 0])], "/padded", mode="constant")
    if in_ch == 1 and stride > 1 and kernel % stride == 0 and padded % stride == 0:
        x = add("Reshape", [x, const("/block_shape", [-1, padded // stride, stride])], "/blocks")
        taps, width, step = kernel // stride, stride, 1
        matrix = w.reshape(out_ch, kernel).T
    else:
        taps, width, step = kernel, in_ch, stride
        matrix = w.transpose(2, 1, 0).reshape(kernel * in_ch, out_ch)  # row j * C + c: tap j, channel c
    span, axis, step_ = (frames - 1) * step + 1, const("/axis", [1]), const("/step", [step])
    cols = [add("Slice", [x, const(f"/start{j}", [j]), const(f"/end{j}", [j + span]), axis, step_], f"/tap{j}")
            for j in range(taps)]
    rows = add("Reshape", [add("Concat", cols, "/cols", axis=2), const("/row_shape", [-1, taps * width])], "/rows")
    y = add("MatMul", [rows, const("/weight", np.ascontiguousarray(matrix, dtype=np.float32))], "/product")
    if len(node.input) > 2 and node.input[2]:
        if node.input[2] not in weights:
            raise UnexpectedGraph(f"convolution {node.name} has a computed bias")
        y = add("Add", [y, const("/bias", weights[node.input[2]])], "/biased")
    y = add("Reshape", [y, const("/out_shape", [-1, frames, out_ch])], "/frames")
    made.append(helper.make_node("Transpose", [y], [node.output[0]], perm=[0, 2, 1]))
    return made


def _without_unused_constants(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    """Drop the Constant nodes nothing reads any more (the replaced kernels, the branches not
    taken), which ONNX Runtime would otherwise warn about on every start."""
    used = set(outputs)
    for node in nodes:
        used.update(_reads(node))
    return [node for node in nodes if node.op_type != "Constant" or node.output[0] in used]


def _reads(node: onnx.NodeProto) -> set[str]:
    """Every name a node reads, its subgraphs' outer-scope names included."""
    names = set(node.input)
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            for inner in attr.g.node:
                names |= _reads(inner)
    return names

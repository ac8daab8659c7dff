"""Test models built in code with ``onnx.helper``: no torch, no downloads, same bytes every build.

Each model is described by a :class:`BuiltSpec`. Its cache key hashes the spec's name, version,
seed, opset and IR version, so a cached file is reused only for the same spec: **bump
``version`` whenever a builder's output changes**, or stale files will be served from caches.

Weights are random (He-style init from a fixed seed), scaled so that activations stay O(1)
through the whole network; outputs are finite on random inputs but mean nothing.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from modelzoo.cache import atomic_write, models_dir
from modelzoo.inputs import BATCH, InputHint

logger = logging.getLogger(__name__)

OPSET = 17
IR_VERSION = 8
"""IR 8 is the lowest that carries opset 17, so older runtimes on the GPU nodes can load these."""

PRODUCER = "edge-offload modelzoo"
BATCH_DIM = "N"
LICENSE = "Apache-2.0"  # the project's own license: these models are its output

TRANSFORMER_VOCAB = 1000
TRANSFORMER_SEQ = 128
TRANSFORMER_D_MODEL = 128
TRANSFORMER_HEADS = 4
TRANSFORMER_FFN = 512
TRANSFORMER_LAYERS = 2


class _Graph:
    """Accumulates nodes and initializers of one graph; every value gets a unique name."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._counter = 0
        self._scalars: dict[float, str] = {}

    def _fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}_{self._counter}"

    def const(self, prefix: str, array: np.ndarray) -> str:
        name = self._fresh(prefix)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def scalar(self, value: float) -> str:
        """Return a shared 0-d float32 initializer holding ``value``."""
        if value not in self._scalars:
            self._scalars[value] = self.const("scalar", np.array(value, dtype=np.float32))
        return self._scalars[value]

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs: Any) -> str:
        out = output or self._fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def weight(self, shape: tuple[int, ...], fan_in: int, gain: float) -> np.ndarray:
        """He-style init: N(0, gain / fan_in); gain 2 before a ReLU, 1 for a linear layer."""
        std = math.sqrt(gain / fan_in)
        return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def bias(self, size: int) -> np.ndarray:
        """Small random bias, standing in for a BatchNorm folded into the preceding layer."""
        return self.rng.standard_normal(size, dtype=np.float32) * np.float32(0.01)

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        group: int = 1,
        gain: float = 2.0,
    ) -> str:
        w = self.weight((cout, cin // group, k, k), fan_in=cin // group * k * k, gain=gain)
        return self.op(
            "Conv",
            [x, self.const("conv_w", w), self.const("conv_b", self.bias(cout))],
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
            group=group,
        )

    def gemm(self, x: str, fin: int, fout: int, gain: float, output: str | None = None) -> str:
        """Fully connected layer as PyTorch exports it: Gemm with weight [fout, fin], transB=1."""
        w = self.const("fc_w", self.weight((fout, fin), fan_in=fin, gain=gain))
        return self.op("Gemm", [x, w, self.const("fc_b", self.bias(fout))], output, transB=1)

    def linear(self, x: str, fin: int, fout: int, gain: float) -> str:
        """MatMul + Add over the last axis, for inputs of any rank."""
        w = self.const("linear_w", self.weight((fin, fout), fan_in=fin, gain=gain))
        return self.op("Add", [self.op("MatMul", [x, w]), self.const("linear_b", self.bias(fout))])

    def relu(self, x: str) -> str:
        return self.op("Relu", [x])

    def relu6(self, x: str) -> str:
        return self.op("Clip", [x, self.scalar(0.0), self.scalar(6.0)])

    def graph(
        self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]
    ) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)


def _image_input() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("input", TensorProto.FLOAT, [BATCH_DIM, 3, 224, 224])


def _logits(classes: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH_DIM, classes])


def _classifier(g: _Graph, x: str, channels: int) -> str:
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    return g.gemm(pooled, channels, 1000, gain=1.0, output="logits")


def _mlp(rng: np.random.Generator) -> onnx.GraphProto:
    g = _Graph(rng)
    x = g.relu(g.gemm("input", 256, 512, gain=2.0))
    x = g.relu(g.gemm(x, 512, 256, gain=2.0))
    g.gemm(x, 256, 10, gain=1.0, output="logits")
    source = helper.make_tensor_value_info("input", TensorProto.FLOAT, [BATCH_DIM, 256])
    return g.graph("mlp", [source], [_logits(10)])


def _basic_block(g: _Graph, x: str, cin: int, cout: int, stride: int) -> str:
    branch = g.relu(g.conv(x, cin, cout, 3, stride))
    # Without BatchNorm statistics to tame them, residual sums double the variance per block;
    # a small gain on the branch's last conv (like zero-init-residual) keeps it near constant.
    branch = g.conv(branch, cout, cout, 3, gain=0.25)
    shortcut = x if stride == 1 and cin == cout else g.conv(x, cin, cout, 1, stride, gain=1.0)
    return g.relu(g.op("Add", [shortcut, branch]))


def _resnet18(rng: np.random.Generator) -> onnx.GraphProto:
    g = _Graph(rng)
    x = g.relu(g.conv("input", 3, 64, 7, stride=2))
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = _basic_block(g, x, cin, cout, stride)
        x = _basic_block(g, x, cout, cout, 1)
        cin = cout
    _classifier(g, x, 512)
    return g.graph("resnet18", [_image_input()], [_logits(1000)])


# (expansion t, output channels c, repeats n, first stride s), from the MobileNetV2 paper.
_MOBILENETV2_BLOCKS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _inverted_residual(g: _Graph, x: str, cin: int, cout: int, stride: int, t: int) -> str:
    hidden = cin * t
    h = g.relu6(g.conv(x, cin, hidden, 1)) if t != 1 else x
    h = g.relu6(g.conv(h, hidden, hidden, 3, stride, group=hidden))
    if stride == 1 and cin == cout:
        return g.op("Add", [x, g.conv(h, hidden, cout, 1, gain=0.25)])
    return g.conv(h, hidden, cout, 1, gain=1.0)


def _mobilenetv2(rng: np.random.Generator) -> onnx.GraphProto:
    g = _Graph(rng)
    x = g.relu6(g.conv("input", 3, 32, 3, stride=2))
    cin = 32
    for t, cout, repeats, first_stride in _MOBILENETV2_BLOCKS:
        for i in range(repeats):
            x = _inverted_residual(g, x, cin, cout, first_stride if i == 0 else 1, t)
            cin = cout
    x = g.relu6(g.conv(x, cin, 1280, 1))
    _classifier(g, x, 1280)
    return g.graph("mobilenetv2", [_image_input()], [_logits(1000)])


def _layer_norm(g: _Graph, x: str, output: str | None = None) -> str:
    d = TRANSFORMER_D_MODEL
    scale = g.const("ln_scale", np.ones(d, dtype=np.float32))
    shift = g.const("ln_bias", np.zeros(d, dtype=np.float32))
    return g.op("LayerNormalization", [x, scale, shift], output, axis=-1, epsilon=1e-5)


def _attention(g: _Graph, x: str) -> str:
    d, heads = TRANSFORMER_D_MODEL, TRANSFORMER_HEADS
    split = g.const("split_heads", np.array([0, 0, heads, d // heads], dtype=np.int64))
    merge = g.const("merge_heads", np.array([0, 0, d], dtype=np.int64))

    def project(perm: list[int]) -> str:
        per_head = g.op("Reshape", [g.linear(x, d, d, gain=1.0), split])
        return g.op("Transpose", [per_head], perm=perm)

    q = project([0, 2, 1, 3])  # [N, heads, seq, d_head]
    k = project([0, 2, 3, 1])  # [N, heads, d_head, seq]
    v = project([0, 2, 1, 3])
    scores = g.op("Mul", [g.op("MatMul", [q, k]), g.scalar(1.0 / math.sqrt(d // heads))])
    context = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    merged = g.op("Reshape", [g.op("Transpose", [context], perm=[0, 2, 1, 3]), merge])
    return g.linear(merged, d, d, gain=1.0)


def _gelu(g: _Graph, x: str) -> str:
    """Exact GELU from Erf (the Gelu op needs opset 20); runtimes fuse this pattern."""
    erf = g.op("Erf", [g.op("Div", [x, g.scalar(math.sqrt(2.0))])])
    return g.op("Mul", [g.op("Mul", [x, g.op("Add", [erf, g.scalar(1.0)])]), g.scalar(0.5)])


def _transformer(rng: np.random.Generator) -> onnx.GraphProto:
    g = _Graph(rng)
    d = TRANSFORMER_D_MODEL
    embedding = rng.standard_normal((TRANSFORMER_VOCAB, d), dtype=np.float32)
    position = rng.standard_normal((TRANSFORMER_SEQ, d), dtype=np.float32)
    tokens = g.op("Gather", [g.const("token_embedding", embedding), "input_ids"], axis=0)
    x = g.op("Add", [tokens, g.const("position_embedding", position)])
    for _ in range(TRANSFORMER_LAYERS):  # pre-LN encoder layers
        x = g.op("Add", [x, _attention(g, _layer_norm(g, x))])
        ffn = _gelu(g, g.linear(_layer_norm(g, x), d, TRANSFORMER_FFN, gain=2.0))
        x = g.op("Add", [x, g.linear(ffn, TRANSFORMER_FFN, d, gain=1.0)])
    _layer_norm(g, x, output="hidden")
    seq = TRANSFORMER_SEQ
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [BATCH_DIM, seq])
    hidden = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [BATCH_DIM, seq, d])
    return g.graph("transformer", [ids], [hidden])


@dataclass(frozen=True, slots=True)
class BuiltSpec:
    """A model built in code. ``make_graph`` must be a pure function of the generator it gets."""

    name: str
    version: int
    seed: int
    description: str
    make_graph: Callable[[np.random.Generator], onnx.GraphProto]
    input_hints: tuple[InputHint, ...] = ()

    @property
    def key(self) -> str:
        """First 16 hex digits of the sha256 of everything that determines the model's bytes."""
        spec = f"{self.name}:v{self.version}:seed{self.seed}:opset{OPSET}:ir{IR_VERSION}"
        return hashlib.sha256(spec.encode()).hexdigest()[:16]

    @property
    def path(self) -> Path:
        """Where the model is (or will be) cached; computing it builds nothing."""
        return models_dir() / f"{self.name}-{self.key}.onnx"

    @property
    def source(self) -> str:
        return f"generated by modelzoo/builders.py (random weights, seed {self.seed})"


SPECS: dict[str, BuiltSpec] = {
    spec.name: spec
    for spec in (
        BuiltSpec("mlp", 1, 0, "MLP 256-512-256-10, input [N,256] -> logits [N,10]", _mlp),
        BuiltSpec(
            "resnet18",
            1,
            0,
            "ResNet-18 (BatchNorm folded), input [N,3,224,224] -> logits [N,1000]",
            _resnet18,
        ),
        BuiltSpec(
            "mobilenetv2",
            1,
            0,
            "MobileNetV2 (width 1.0, BatchNorm folded), input [N,3,224,224] -> logits [N,1000]",
            _mobilenetv2,
        ),
        BuiltSpec(
            "transformer",
            1,
            0,
            f"{TRANSFORMER_LAYERS}-layer transformer encoder (d_model {TRANSFORMER_D_MODEL}, "
            f"{TRANSFORMER_HEADS} heads, vocab {TRANSFORMER_VOCAB}), input_ids [N,"
            f"{TRANSFORMER_SEQ}] -> hidden [N,{TRANSFORMER_SEQ},{TRANSFORMER_D_MODEL}]",
            _transformer,
            (InputHint("input_ids", (BATCH, TRANSFORMER_SEQ), (0, TRANSFORMER_VOCAB)),),
        ),
    )
}


def build_model(spec: BuiltSpec) -> onnx.ModelProto:
    """Build ``spec``'s model in memory and validate it with ``onnx.checker.check_model``.

    Deterministic: two calls give models that serialize to identical bytes.
    """
    graph = spec.make_graph(np.random.default_rng(spec.seed))
    graph.doc_string = spec.description
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name=PRODUCER,
        model_version=spec.version,
    )
    helper.set_model_props(model, {"edge_offload.model": spec.name, "edge_offload.key": spec.key})
    onnx.checker.check_model(model, full_check=True)
    return model


def ensure_built(spec: BuiltSpec) -> Path:
    """Return ``spec.path``, building and atomically writing the model first if it is absent."""
    path = spec.path
    if path.exists():
        logger.debug("%s: cached at %s", spec.name, path)
        return path
    started = time.perf_counter()
    atomic_write(path, build_model(spec).SerializeToString())
    logger.info("%s: built in %.2fs -> %s", spec.name, time.perf_counter() - started, path)
    return path

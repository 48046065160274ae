"""int8 copies of an ONNX graph (R1.5): which MatMuls get int8 weights, and how.

Two onnxruntime kernels run int8 MatMuls on the CPU's VNNI / AMX int8 units:

- **dynamic** (``quantize_dynamic``: MatMulInteger): int8 weights per output channel, the
  activations quantized to uint8 per forward with one scale for the whole tensor. Fast, but a
  single scale per tensor loses the small values beside an outlier; on all-MiniLM-L6-v2 the
  FFN MatMuls alone each cost up to 2e-3 of cosine.
- **blockwise** (MatMulNBits, 8 bits, ``accuracy_level`` 4): int8 weights with a scale and
  zero point per block of ``block_size`` along K, and the activations quantized per block of
  the same size, so an outlier spoils one block, not the row.

A recipe says which kernel each weighted MatMul gets by its role in the encoder
(``roles``: attention projections, the FFN's up and down projections, the last layer, a head
outside the layers) or leaves it in float32. ``bench/int8_sweep.py`` measured the recipes
(quality against float32 on the gate's texts, forward speed against onnxruntime float32) and
``DEFAULT`` is the one it chose; the gate still decides per model at load.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DYNAMIC, BLOCKWISE, FLOAT = "dynamic", "blockwise", "float32"
ROLES = ("attention", "ffn_in", "ffn_out", "head")
_LAYER = re.compile(r"layers?[./_](\d+)[./_]")
_ATTENTION = re.compile(r"attn|attention", re.IGNORECASE)


@dataclass(frozen=True)
class WeightedMatMul:
    """A MatMul whose second input is a constant ``[k, n]`` weight."""

    name: str
    k: int
    n: int


@dataclass(frozen=True)
class Recipe:
    """How each role is quantized: DYNAMIC, BLOCKWISE or FLOAT (left in float32)."""

    name: str
    attention: str = DYNAMIC
    ffn_in: str = DYNAMIC
    ffn_out: str = DYNAMIC
    head: str = FLOAT
    last_layer: str | None = None  # set: the last layer's MatMuls all get this instead
    per_channel: bool = True  # dynamic: a weight scale per output channel (else per tensor)
    reduce_range: bool = False  # dynamic: 7-bit weights (for CPUs without VNNI)
    embeddings: bool = False  # dynamic: int8 embedding tables (Gather) too
    block_size: int = 32  # blockwise: K elements per scale

    def kernel(self, role: str, last: bool) -> str:
        if last and self.last_layer is not None and role != "head":
            return self.last_layer
        return getattr(self, role)


def role(node: WeightedMatMul) -> tuple[str, int | None]:
    """A MatMul's role in an encoder and its layer index (None: outside the layers), from its
    name (exporters name nodes after module paths: ``layer.3``, ``layers.3``) and its shape:
    a down projection (k > n) inside a layer is the FFN's output; other non-attention ones
    its input."""
    m = _LAYER.search(node.name)
    if m is None:
        return "head", None
    layer = int(m.group(1))
    if _ATTENTION.search(node.name):
        return "attention", layer
    return ("ffn_out" if node.k > node.n else "ffn_in"), layer


def plan(nodes: list[WeightedMatMul], recipe: Recipe) -> dict[str, str]:
    """Node name -> the kernel the recipe gives it (DYNAMIC, BLOCKWISE or FLOAT)."""
    placed = [(n, *role(n)) for n in nodes]
    layers = [layer for _, _, layer in placed if layer is not None]
    last = max(layers) if layers else None
    return {n.name: recipe.kernel(r, layer is not None and layer == last)
            for n, r, layer in placed}


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("dynamic"),
    Recipe("dynamic-embeddings", embeddings=True),
    Recipe("dynamic-per-tensor", per_channel=False),
    Recipe("dynamic-reduce-range", reduce_range=True),
    Recipe("dynamic-ffn-out-float", ffn_out=FLOAT),
    Recipe("dynamic-ffn-out-float-last-float", ffn_out=FLOAT, last_layer=FLOAT),
    Recipe("dynamic-attention-only", ffn_in=FLOAT, ffn_out=FLOAT),
    Recipe("blockwise-32", BLOCKWISE, BLOCKWISE, BLOCKWISE),
    Recipe("blockwise-16", BLOCKWISE, BLOCKWISE, BLOCKWISE, block_size=16),
    Recipe("blockwise-32-last-float", BLOCKWISE, BLOCKWISE, BLOCKWISE, last_layer=FLOAT),
    Recipe("attention-dynamic-ffn-blockwise-16", DYNAMIC, BLOCKWISE, BLOCKWISE,
           block_size=16),
)}
# Chosen by bench/int8_sweep.py (bench/results/int8_sweep.json; one run of 10 interleaved
# rounds on a loaded 2-vCPU AMD EPYC without AMX): the only recipe that passed the default
# gate (0.999) on both built-in models (L6 0.99950, L3 0.99989), at 1.14-1.42x onnxruntime
# float32; the per-tensor ones ran 1.5-2.3x but reached 0.94-0.98 on L6.
DEFAULT = RECIPES["blockwise-16"]


def weighted_matmuls(model) -> list[WeightedMatMul]:
    """The graph's MatMuls whose second input is a 2-D float initializer."""
    from onnx import TensorProto

    weights = {t.name: tuple(t.dims) for t in model.graph.initializer
               if t.data_type == TensorProto.FLOAT and len(t.dims) == 2}
    return [WeightedMatMul(node.name, *weights[node.input[1]]) for node in model.graph.node
            if node.op_type == "MatMul" and node.input[1] in weights and node.name]


def block_quantize(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w`` [k, n] as MatMulNBits' 8-bit layout: uint8 codes [n, blocks, block_size], float
    scales and uint8 zero points [n, blocks]; asymmetric per block, zero exactly
    representable; K is padded with zeros to whole blocks."""
    k, n = w.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = w
    b = padded.T.reshape(n, blocks, block_size)
    lo = np.minimum(b.min(-1), 0.0)
    hi = np.maximum(b.max(-1), 0.0)
    scale = np.where(hi > lo, (hi - lo) / 255.0, 1.0).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, 255)
    codes = np.clip(np.round(b / scale[..., None]) + zero[..., None], 0, 255)
    return codes.astype(np.uint8), scale, zero.astype(np.uint8)


def _blockwise(model, names: set[str], block_size: int) -> None:
    """Replace the named MatMuls by 8-bit MatMulNBits nodes, in place."""
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    graph = model.graph
    for i, node in enumerate(graph.node):
        if node.name not in names:
            continue
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        codes, scale, zero = block_quantize(w, block_size)
        base = f"{node.input[1]}_q8b{block_size}"
        graph.initializer.extend([numpy_helper.from_array(codes, base),
                                  numpy_helper.from_array(scale, base + "_scales"),
                                  numpy_helper.from_array(zero, base + "_zero_points")])
        graph.node[i].CopyFrom(helper.make_node(
            "MatMulNBits", [node.input[0], base, base + "_scales", base + "_zero_points"],
            list(node.output), name=node.name + "_q8b", domain="com.microsoft",
            K=w.shape[0], N=w.shape[1], bits=8, block_size=block_size, accuracy_level=4))
    used = {x for node in graph.node for x in node.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def quantize(source: Path, target: Path, recipe: Recipe = DEFAULT) -> dict[str, str]:
    """Write ``source`` with ``recipe``'s int8 MatMuls to ``target``; returns the plan."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(source))
    kernels = plan(weighted_matmuls(model), recipe)
    _blockwise(model, {n for n, k in kernels.items() if k == BLOCKWISE}, recipe.block_size)
    dynamic = [n for n, k in kernels.items() if k == DYNAMIC]
    if not dynamic and not recipe.embeddings:
        onnx.save(model, str(target))
        return kernels
    keep = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in dynamic]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # the quantizer logs every tensor on the root
        try:
            quantize_dynamic(model, str(target), weight_type=QuantType.QInt8,
                             per_channel=recipe.per_channel, reduce_range=recipe.reduce_range,
                             op_types_to_quantize=["MatMul", "Gather"] if recipe.embeddings
                             else ["MatMul"], nodes_to_exclude=keep)
        finally:
            logging.disable(logging.NOTSET)
    return kernels

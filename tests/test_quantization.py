"""R1.5 (as amended): the int8 recipe — which MatMuls of an encoder get int8 weights and which
kernel runs them — and the gate's verdict on the built-in model's int8 copy.

Quality figures depend on the CPU's kernels (VNNI here, AMX elsewhere): the real-model test
asserts the gate's contract (passes exactly when the figure reaches the threshold, a refusal
names the figure), not a figure."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import L6
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.quality import GateThresholds
from vllm_srun.runtime.quantization import (
    BLOCKWISE,
    DEFAULT,
    DYNAMIC,
    FLOAT,
    RECIPES,
    Recipe,
    WeightedMatMul,
    block_quantize,
    plan,
    role,
)
from vllm_srun.runtime.selection import choose


def _bert(layers: int, prefix: str = "/inner/encoder") -> list[WeightedMatMul]:
    """A BERT export's weighted MatMuls (torch.onnx names them after module paths)."""
    nodes = []
    for i in range(layers):
        at = f"{prefix}/layer.{i}"
        nodes += [WeightedMatMul(f"{at}/attention/self/{p}/MatMul", 384, 384)
                  for p in ("query", "key", "value")]
        nodes += [WeightedMatMul(f"{at}/attention/output/dense/MatMul", 384, 384),
                  WeightedMatMul(f"{at}/intermediate/dense/MatMul", 384, 1536),
                  WeightedMatMul(f"{at}/output/dense/MatMul", 1536, 384)]
    return nodes


def test_roles_of_a_bert_and_a_modernbert_graph():
    """Roles come from module paths (``layer.N`` / ``layers.N``, ``attention`` / ``attn``)
    and shapes (a down projection is the FFN's output), so other exporters' prefixes and
    ModernBERT's fused projections are placed too."""
    got = [role(n) for n in _bert(1, "/model/model.0/auto_model/encoder")]
    assert got == [("attention", 0)] * 4 + [("ffn_in", 0), ("ffn_out", 0)]
    modern = [WeightedMatMul("/inner/layers.11/attn/Wqkv/MatMul", 768, 2304),
              WeightedMatMul("/inner/layers.11/attn/Wo/MatMul", 768, 768),
              WeightedMatMul("/inner/layers.11/mlp/Wi/MatMul", 768, 2304),
              WeightedMatMul("/inner/layers.11/mlp/Wo/MatMul", 1152, 768),
              WeightedMatMul("/classifier/MatMul", 768, 3)]
    assert [role(n) for n in modern] == [("attention", 11), ("attention", 11), ("ffn_in", 11),
                                         ("ffn_out", 11), ("head", None)]


def test_plan_gives_each_role_its_kernel_and_the_last_layer_its_own():
    nodes = [*_bert(3), WeightedMatMul("/classifier/MatMul", 384, 2)]
    recipe = Recipe("x", attention=DYNAMIC, ffn_in=BLOCKWISE, ffn_out=FLOAT, last_layer=FLOAT)
    kernels = plan(nodes, recipe)
    assert kernels["/inner/encoder/layer.0/attention/self/value/MatMul"] == DYNAMIC
    assert kernels["/inner/encoder/layer.1/intermediate/dense/MatMul"] == BLOCKWISE
    assert kernels["/inner/encoder/layer.1/output/dense/MatMul"] == FLOAT
    assert {k for n, k in kernels.items() if "layer.2" in n} == {FLOAT}
    assert kernels["/classifier/MatMul"] == FLOAT  # heads stay float32 unless a recipe says
    assert set(plan(_bert(6), DEFAULT).values()) == {BLOCKWISE}
    assert DEFAULT is RECIPES[DEFAULT.name]


def test_block_quantize_round_trips_within_half_a_step_and_keeps_zero():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (40, 3)).astype(np.float32)  # K=40: pads to 3 blocks of 16
    w[0, 0], w[5, 1] = 2.0, 0.0  # an outlier spoils its own block only
    codes, scale, zero = block_quantize(w, 16)
    assert codes.shape == (3, 3, 16) and scale.shape == zero.shape == (3, 3)
    back = ((codes.astype(np.float32) - zero[..., None]) * scale[..., None])
    back = back.reshape(3, 48).T[:40]
    step = np.repeat(scale.T, 16, axis=0)[:40]
    assert np.all(np.abs(back - w) <= step / 2 + 1e-7)
    assert back[5, 1] == 0.0
    assert scale[0, 1] < scale[0, 0] / 10  # column 1's first block: no outlier, fine steps


def test_int8_of_the_built_in_model_passes_the_gate_or_names_its_figure():
    """``--dtype int8`` on the default model (onnxruntime, the default recipe) serves only
    with a passing verdict; refused, the reason names the figure, its value and the
    threshold."""
    m = resolve(L6)
    _, choice = choose(m, "onnxruntime", "int8", GateThresholds(), 1,
                       lambda p: load_backend(m, "onnxruntime", precision=p))
    measured = choice.measured["int8"]
    assert measured["texts"] == 32
    if measured["min_cosine"] >= 0.999:
        assert choice.refusal is None
    else:
        assert choice.refusal == (
            f"quality gate: min_cosine {measured['min_cosine']:.8f} is below the threshold "
            "quality_gate.min_cosine 0.999 (against float32 on 32 evaluation texts)")


@pytest.mark.parametrize("name", ["dynamic-ffn-out-float", "blockwise-32-last-float"])
def test_a_recipe_writes_a_graph_onnxruntime_runs(tmp_path, name):
    """Mixed recipes (float32, MatMulInteger and MatMulNBits nodes in one graph) load and
    answer; every weighted MatMul is placed."""
    from vllm_srun.runtime.backend import OnnxBackend
    from vllm_srun.runtime.engine import pad
    from vllm_srun.runtime.export import ensure_onnx
    from vllm_srun.runtime.quantization import quantize

    m = resolve(L6)
    kernels = quantize(ensure_onnx(m), tmp_path / "q.onnx", RECIPES[name])
    assert len(kernels) == 36 and FLOAT in kernels.values()
    out = OnnxBackend(m, str(tmp_path / "q.onnx")).forward(pad([[101, 2023, 102]]), 1)
    assert out.outputs.shape == (1, 384) and np.isfinite(out.outputs).all()

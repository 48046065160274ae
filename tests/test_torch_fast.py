"""The torch backend runs its module made faster (``torch_fast.faster``): traced, the same
operators without transformers' Python between them, so the answers must be those of the
module as loaded (bfloat16: with its ``Linear`` weights packed), bit for bit, at every thread
count, for every task and precision; where a trace would answer otherwise the module runs
untraced."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch

from tests.conftest import L6
from vllm_srun.runtime import torch_fast
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.backend import load_backend
from vllm_srun.runtime.engine import pad
from vllm_srun.runtime.precision import Precision
from vllm_srun.runtime.threads import ThreadContext
from vllm_srun.runtime.torch_fast import faster, pack, packs, weights
from vllm_srun.runtime.torch_model import load_module
from vllm_srun.runtime.weights import align


def batches(config, pairs: bool) -> list:
    """Row lengths of the served shapes: one short row, padded batches, one long row (as long
    as the model takes, up to 200)."""
    rng = np.random.default_rng(5)
    longest = min(200, config.max_position_embeddings - 2)  # (XLM-R: positions from 2)
    out = []
    for lengths in ((7,), (9, 30, 17), (64,) * 4 + (3,), (longest,)):
        rows = [[int(t) for t in rng.integers(5, config.vocab_size, n)] for n in lengths]
        kinds = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths] if pairs else None
        out.append(pad(rows, kinds))
    return out


def same_as_loaded(manifest, precision: Precision = Precision.FLOAT32,
                   pairs: bool = False) -> str:
    """The torch backend's module against the module as loaded, bit for bit, on each batch at
    1 and 2 threads (each on its own lane); returns the served module's class name."""
    served = load_backend(manifest, "torch", precision=precision).module
    loaded = load_module(manifest, precision)
    if precision is not Precision.INT8:  # laid out as the served weights are (``align``)
        align(loaded)
    if packs(precision):
        with torch.inference_mode():
            pack(torch, loaded)
    lanes = ThreadContext()
    try:
        for batch in batches(loaded.inner.config, pairs):
            args = [torch.from_numpy(a) for a in (batch.input_ids, batch.attention_mask)]
            if batch.token_type_ids is not None:
                args.append(torch.from_numpy(batch.token_type_ids))
            for n in (1, 2):
                def both(args=args):
                    with torch.inference_mode():
                        return served(*args), loaded(*args)
                got, want = lanes.run(n, both)
                assert got.dtype == want.dtype and torch.equal(got, want), (batch.rows, n)
    finally:
        lanes.shutdown()
    return type(served).__name__


@pytest.mark.parametrize("precision", list(Precision))
def test_the_default_model_is_served_traced_answering_as_loaded(precision):
    assert same_as_loaded(resolve(L6), precision) == "TracedEncoder"


def test_a_cross_encoder_is_served_traced_answering_pairs_as_loaded(cross_encoder_dir):
    assert same_as_loaded(resolve(str(cross_encoder_dir)), pairs=True) == "TracedEncoder"


def test_other_encoders_answer_as_loaded_traced_or_not(token_classifier_dir, xlmr_dir,
                                                      modernbert_dir, classifier_dir):
    """Token classification, XLM-RoBERTa (one token type), ModernBERT (local attention
    windows): traced or not, the answers are the loaded module's."""
    kinds = {folder.name: same_as_loaded(resolve(str(folder)))
             for folder in (token_classifier_dir, xlmr_dir, modernbert_dir, classifier_dir)}
    print(kinds)


class Branchy(torch.nn.Module):
    """An encoder whose Python takes a branch on the data (how many rows are padded): a trace
    keeps the branch its example took, so it answers padded batches otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100))
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        hidden = input_ids.unsqueeze(-1).float() * self.scale
        if bool((attention_mask == 0).any()):
            hidden = hidden + 1
        return hidden


def test_a_module_a_trace_would_answer_otherwise_runs_untraced(caplog):
    module = Branchy().eval()
    with caplog.at_level(logging.WARNING, logger="vllm_srun.runtime"):
        assert faster(module, Precision.FLOAT32) is module
    assert "torch_trace_unused reason=differs" in caplog.text


def test_a_long_input_runs_the_module_as_loaded(modernbert_dir):
    """Past ``attention.MIN_TOKENS`` tokens ModernBERT's local layers take ``attention.py``'s
    windowed path, chosen on the data; a trace made on a short example would run sdpa over
    the whole mask there (answers differing in the last bits, and slower). Such inputs run
    the module as loaded, traced or not below."""
    manifest = resolve(str(modernbert_dir))
    served = load_backend(manifest, "torch").module
    loaded = load_module(manifest)
    align(loaded)
    assert type(served).__name__ == "TracedEncoder"
    rng = np.random.default_rng(9)
    batch = pad([[int(t) for t in rng.integers(5, 400, n)] for n in (700, 600)])
    args = [torch.from_numpy(batch.input_ids), torch.from_numpy(batch.attention_mask)]
    with torch.inference_mode():
        assert torch.equal(served(*args), loaded(*args))


def test_bfloat16_linear_weights_are_packed_where_onednn_runs_bfloat16():
    if not packs(Precision.BFLOAT16):
        pytest.skip("oneDNN does not run bfloat16 on this CPU: weights stay as loaded")
    served = load_backend(resolve(L6), "torch", precision="bfloat16").module
    linears = [m for m in load_module(resolve(L6), Precision.BFLOAT16).modules()
               if type(m) is torch.nn.Linear]
    source = served.source  # the module the trace was made from
    packed = {b._cdata: name for name, b in source.named_buffers() if name.endswith(".packed")}
    # each layer's query, key and value projections: one packed product
    fused = [name for name, _ in source.named_modules() if name.endswith(".fused_projections")]
    assert len(fused) == source.inner.config.num_hidden_layers
    assert linears and len(packed) == len(linears) - 2 * len(fused)
    assert not any(isinstance(m, torch.nn.Linear) for m in source.modules())
    # the frozen trace's products read the packed weights themselves (oneDNN's opaque
    # tensors), not copies: one per product (the pooler's, which no forward calls, unread)
    reads = {t._cdata for t in weights(served) if t.is_mkldnn}
    products = served.script.graph.findAllNodes("mkldnn::_linear_pointwise")
    assert reads <= packed.keys() and len(reads) == len(products) >= len(packed) - 1
    float32 = load_backend(resolve(L6), "torch").module
    assert not [name for name, _ in float32.source.named_buffers()
                if name.endswith(".packed")]


def test_the_fused_projections_answer_as_three_products(monkeypatch):
    """The attention's query, key and value as one packed product answer as the three packed
    on their own (a part given another's slice, or a slice of the wrong width, would not):
    every row's cosine to theirs at least 0.99999, at 1 and 2 threads. The module as loaded,
    run as a second forward at once would run it: a part whose input is not the one the
    product was computed for computes it again."""
    if not packs(Precision.BFLOAT16):
        pytest.skip("oneDNN does not run bfloat16 on this CPU: weights stay as loaded")
    with torch.inference_mode():
        fused = load_module(resolve(L6), Precision.BFLOAT16)
        pack(torch, fused)
        monkeypatch.setattr(torch_fast, "PROJECTIONS", ("no", "such", "names"))
        apart = load_module(resolve(L6), Precision.BFLOAT16)
        pack(torch, apart)
    assert not [n for n, _ in apart.named_modules() if n.endswith("fused_projections")]
    attention = next(m for n, m in fused.named_modules() if n.endswith("attention.self"))
    lanes = ThreadContext()
    try:
        for batch in batches(fused.inner.config, False):
            args = [torch.from_numpy(a) for a in (batch.input_ids, batch.attention_mask)]
            for n in (1, 2):
                def both(args=args):
                    with torch.inference_mode():
                        x = torch.ones(1, 3, 384, dtype=torch.bfloat16)
                        attention.query(x)  # a product for another input, left half used
                        return fused(*args).float(), apart(*args).float()
                got, want = lanes.run(n, both)
                cos = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1))
                assert cos.min() >= 0.99999, (batch.rows, n, cos.min())
    finally:
        lanes.shutdown()


@pytest.mark.parametrize("precision", [Precision.FLOAT32, Precision.BFLOAT16])
def test_the_frozen_trace_reads_the_loaded_modules_own_tensors(precision):
    """Frozen, the trace reads its weights as constants: the module's own tensors, so the
    weights stay one copy (mapped from the shared file) and a fault set in a parameter by
    name reaches the served answer."""
    served = load_backend(resolve(L6), "torch", precision=precision).module
    assert type(served).__name__ == "TracedEncoder"
    def key(t):  # a constant is its own tensor object over the same storage
        return t._cdata if t.is_mkldnn else t.data_ptr()

    own = {key(t) for t in [*served.source.parameters(), *served.source.buffers()]}
    read = weights(served)
    assert len(read) > 50 and all(key(t) in own for t in read)
    assert not list(served.script.parameters())  # constants, not attributes: frozen
    batch = [torch.from_numpy(a) for a in (pad([[101, 2000, 102]]).input_ids,
                                            pad([[101, 2000, 102]]).attention_mask)]
    with torch.inference_mode():
        before = served(*batch)
    norm = next(p for name, p in served.named_parameters() if name.endswith("LayerNorm.bias"))
    with torch.no_grad():
        norm += 1
    with torch.inference_mode():
        assert not torch.equal(served(*batch), before)

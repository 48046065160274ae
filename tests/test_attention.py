"""Windowed attention for local layers (runtime/attention.py): a ModernBERT's local layers
score only their window, and the answers stay sdpa's at float32 (R1.3, R7.4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import ModernBertModel

from vllm_srun.runtime import attention
from vllm_srun.runtime.artifact import resolve
from vllm_srun.runtime.torch_model import load_module


def _rows(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-looking ids (WordPiece range), padded to the longest with 0s."""
    rng = np.random.default_rng(11)
    longest = max(lengths)
    ids = torch.zeros((len(lengths), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.from_numpy(rng.integers(1000, 20000, n))
        ids[i, 0], ids[i, n - 1] = 101, 102
        mask[i, :n] = 1
    return ids, mask


def _both(folder, ids, mask, spy: list | None = None):
    ours = load_module(resolve(str(folder)))
    ref = ModernBertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        real = torch.nn.functional.scaled_dot_product_attention
        if spy is not None:  # record the key length of every attention call (a spy only)
            def record(q, k, v, **kw):
                spy.append(k.shape[2])
                return real(q, k, v, **kw)
            torch.nn.functional.scaled_dot_product_attention = record
        try:
            got = ours(ids, mask)
        finally:
            torch.nn.functional.scaled_dot_product_attention = real
    return ours, got, want


def test_long_padded_rows_match_sdpa_within_1e5_and_score_only_the_window(modernbert_dir):
    """Two rows past 2 x BLOCK_TOKENS (one padded by 700 tokens): the runtime's module uses the
    windowed implementation, its local layers call attention with keys no longer than block +
    2 x window, and every token's vector equals transformers' sdpa within 1e-5 (padding
    positions too, where a window sees only padding keys: no NaN)."""
    n = 4 * attention.BLOCK_TOKENS + 37
    ids, mask = _rows([n, n - 700])
    spy: list[int] = []
    ours, got, want = _both(modernbert_dir, ids, mask, spy)
    assert ours.inner.config._attn_implementation == attention.NAME
    reach = ours.inner.config.sliding_window + 1
    assert any(k <= attention.BLOCK_TOKENS + 2 * reach for k in spy)  # local layers: windows
    assert n in spy  # the global layer: every key
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("tokens", [5, 2 * attention.BLOCK_TOKENS])
def test_short_inputs_run_sdpa_itself(modernbert_dir, tokens):
    """Up to 2 x BLOCK_TOKENS the windowed implementation hands over to sdpa: bit-identical."""
    ids, mask = _rows([tokens, max(2, tokens // 2)])
    _, got, want = _both(modernbert_dir, ids, mask)
    assert torch.equal(got, want)


def test_models_without_local_layers_keep_their_attention():
    """A BERT has no local layers: the runtime leaves its implementation alone."""
    from transformers import BertConfig, ModernBertConfig

    assert not attention.supports(BertConfig())
    assert attention.supports(ModernBertConfig())

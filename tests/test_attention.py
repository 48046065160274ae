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
    """Two rows past MIN_TOKENS (one padded by 700 tokens): the runtime's module uses the
    windowed implementation, its local layers call attention with keys no longer than block +
    2 x window, its global layer each row against only its own tokens' keys without a mask,
    and every token's vector equals transformers' sdpa within 1e-5 (padding positions too,
    where a window sees only padding keys: no NaN). Were the padded row's padding keys kept
    (its mask dropped, its keys not cut), its vectors would differ far more than 1e-5."""
    n = attention.MIN_TOKENS + 549  # not a multiple of BLOCK_TOKENS: a short last block
    ids, mask = _rows([n, n - 700])
    spy: list[int] = []
    ours, got, want = _both(modernbert_dir, ids, mask, spy)
    assert ours.inner.config._attn_implementation == attention.NAME
    reach = ours.inner.config.sliding_window + 1
    assert any(k <= attention.BLOCK_TOKENS + 2 * reach for k in spy)  # local layers: windows
    assert n in spy and n - 700 in spy  # the global layer: each row's own keys, no padding
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    assert float((got - want).abs().max()) <= 1e-5


def test_long_unpadded_rows_match_sdpa_within_1e5(modernbert_dir):
    """Two rows of the same length past MIN_TOKENS (no padding: the global layer gets no mask
    and runs sdpa itself; the local layers run in blocks): within 1e-5 of transformers' sdpa."""
    n = attention.MIN_TOKENS + 101
    ids, mask = _rows([n, n])
    _, got, want = _both(modernbert_dir, ids, mask)
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("tokens", [5, attention.MIN_TOKENS])
def test_short_inputs_run_sdpa_itself(modernbert_dir, tokens):
    """Up to MIN_TOKENS the windowed implementation hands over to sdpa: bit-identical."""
    ids, mask = _rows([tokens, max(2, tokens // 2)])
    _, got, want = _both(modernbert_dir, ids, mask)
    assert torch.equal(got, want)


def test_models_without_local_layers_keep_their_attention():
    """A BERT has no local layers: the runtime leaves its implementation alone."""
    from transformers import BertConfig, ModernBertConfig

    assert not attention.supports(BertConfig())
    assert attention.supports(ModernBertConfig())


def _padding_mask(lengths: list[int], tokens: int) -> torch.Tensor:
    keep = torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]
    return keep[:, None, None, :].expand(len(lengths), 1, tokens, tokens).clone()


def test_kept_prefixes_accepts_only_right_padding_masks():
    """A global layer's mask is cut to per-row key prefixes only when every query of a row keeps
    exactly its first n keys; anything else (a query-dependent hole, left padding, a row that
    keeps nothing, per-head masks) returns None and runs sdpa with the mask itself."""
    assert attention.kept_prefixes(_padding_mask([6, 3], 6), 2) == [6, 3]
    assert attention.kept_prefixes(_padding_mask([4], 6), 3) == [4, 4, 4]  # broadcast rows
    hole = _padding_mask([6, 3], 6)
    hole[1, 0, 2, 1] = False  # one query of row 1 drops one key its other queries keep
    assert attention.kept_prefixes(hole, 2) is None
    left = _padding_mask([6, 3], 6).flip(-1)  # left padding: keys [3, 6) kept
    assert attention.kept_prefixes(left, 2) is None
    assert attention.kept_prefixes(_padding_mask([6, 0], 6), 2) is None
    assert attention.kept_prefixes(_padding_mask([6, 3], 6).expand(2, 4, 6, 6), 2) is None


def test_a_mask_that_is_not_padding_keeps_its_holes(modernbert_dir):
    """A caller's own masks (transformers' mask mapping) with a hole in the global layer's mask
    for some queries: the runtime's answers equal sdpa's with the same masks within 1e-5, and
    differ from the answers without the hole (so the hole mattered)."""
    n = attention.MIN_TOKENS + 549  # not a multiple of BLOCK_TOKENS: a short last block
    ids, _ = _rows([n, n - 700])
    keep = _padding_mask([n, n - 700], n)
    full = keep.clone()
    full[:, :, : n // 2, n // 2:] = False  # the first half of the queries see only the first half
    reach = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    local = keep & (reach.abs() <= 8)[None, None]  # the tiny config's window
    ours = load_module(resolve(str(modernbert_dir))).inner
    ref = ModernBertModel.from_pretrained(modernbert_dir, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        got, want, plain = (model(input_ids=ids, attention_mask={
            "full_attention": m, "sliding_attention": local}).last_hidden_state
            for model, m in ((ours, full), (ref, full), (ref, keep)))
    assert float((got - want).abs().max()) <= 1e-5
    assert float((plain - want).abs().max()) > 1e-4

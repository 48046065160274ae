"""Windowed attention for encoders whose local layers see only a window of tokens (ModernBERT).

transformers' ``sdpa`` path hands a local (sliding-window) layer the full [tokens x tokens]
mask, and ``scaled_dot_product_attention`` scores every pair, the masked ones included: at
8,192 tokens ModernBERT-base's local layers (two in three) spend ~97% of their attention work
on scores the mask then drops. Here a local layer's queries go in blocks of ``BLOCK_TOKENS``,
each against only the keys its window can reach, with the mask's own slice, so the work grows
with tokens x (block + window) instead of tokens².

Invariant: every score the mask keeps is computed, and every dropped one is exactly zero after
the softmax either way, so the answers are sdpa's up to the order of the sums (float32: within
~1e-6). Global layers, inputs of up to ``2 * BLOCK_TOKENS`` tokens, training, and tracing or
exporting (the ONNX export's shapes must stay symbolic) run transformers' own sdpa unchanged.
"""

from __future__ import annotations

NAME = "sdpa_windowed"
# Queries per block. A guess, from one 4,096-token run on a busy 2-vCPU host: each block also
# scores 2 x window keys outside itself, so blocks much shorter than the window waste work,
# and longer ones score more masked pairs.
BLOCK_TOKENS = 256


def supports(config) -> bool:
    """Whether the model has local layers, and so gains from ``NAME``."""
    return "sliding_attention" in (getattr(config, "layer_types", None) or ())


def register() -> str:
    """Make ``NAME`` an attention implementation transformers can load (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, windowed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def windowed_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: float | None = None, sliding_window: int | None = None,
                       **kwargs):
    """transformers' attention signature: ``query/key/value`` [rows, heads, tokens, dim],
    ``attention_mask`` [rows or 1, 1, tokens, tokens] bool (True: attend)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tokens = query.shape[2]
    if (sliding_window is None or attention_mask is None or attention_mask.dtype != torch.bool
            or tokens <= 2 * BLOCK_TOKENS or module.training or torch.jit.is_tracing()
            or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    reach = int(sliding_window)  # >= the mask's own half-width; the mask decides the rest
    blocks = []
    for start in range(0, tokens, BLOCK_TOKENS):
        end = min(tokens, start + BLOCK_TOKENS)
        lo, hi = max(0, start - reach), min(tokens, end + reach)
        blocks.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, lo:hi], value[:, :, lo:hi],
            attn_mask=attention_mask[:, :, start:end, lo:hi], scale=scaling))
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None

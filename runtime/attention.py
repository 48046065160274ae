"""Attention for long inputs of encoders whose local layers see only a window (ModernBERT).

transformers' ``sdpa`` path hands a local (sliding-window) layer the full [tokens x tokens]
mask, and ``scaled_dot_product_attention`` scores every pair, the masked ones included: at
8,192 tokens ModernBERT-base's local layers (two in three) spend ~97% of their attention work
on scores the mask then drops. Here a local layer's queries go in blocks of ``BLOCK_TOKENS``,
each against only the keys its window can reach, with the mask's own slice, all blocks in one
sdpa call, so the work grows with tokens x (block + window) instead of tokens². A global
layer of a right-padded batch runs each row against its own tokens' keys without a mask (the
mask would only drop the padding keys), so a padded row's attention costs what its length
costs and torch's CPU flash kernel runs without mask work.

Invariant: every score the mask keeps is computed, and every score it drops is either never
computed or exactly zero after the softmax, so the answers are sdpa's up to the order of the
sums (float32: within ~1e-6). Inputs of up to ``MIN_TOKENS`` tokens, masks of any other form,
training, and tracing or exporting (the ONNX export's shapes must stay symbolic) run
transformers' own sdpa unchanged.
"""

from __future__ import annotations

NAME = "sdpa_windowed"
# Queries per local block: the cheapest of 16-512 in ``python -m bench.long_inputs
# --block-sweep`` (bench/results/long_inputs_blocks.json: one 8,192-token local layer, float32
# and bfloat16, one busy 2-vCPU AMD EPYC; 32 cost 0.53-0.57x the CPU time of 256). Each query
# scores block + 2 x reach keys where its window needs 2 x reach - 1, so smaller blocks score
# fewer masked pairs; at 16 the kernel's per-block overhead outweighed that. One run, one CPU.
BLOCK_TOKENS = 32
# Longer inputs take this module's paths; up to here transformers' sdpa runs itself (the
# full mask costs little at these lengths). The windowed path's own threshold before blocks
# were batched, kept as it was: not measured since.
MIN_TOKENS = 512


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
    if (attention_mask is None or attention_mask.dtype != torch.bool
            or tokens <= MIN_TOKENS or module.training or torch.jit.is_tracing()
            or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling()):
        lengths = None
    elif sliding_window is not None:
        reach = int(sliding_window)  # >= the mask's own half-width; the mask decides the rest
        out = local_attention(query, key, value, attention_mask, reach, scaling, BLOCK_TOKENS)
        return out.transpose(1, 2).contiguous(), None
    else:
        lengths = kept_prefixes(attention_mask, query.shape[0])
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[i:i + 1], key[i:i + 1, :, :n], value[i:i + 1, :, :n], scale=scaling)
        for i, n in enumerate(lengths)])
    return out.transpose(1, 2).contiguous(), None


def kept_prefixes(mask, rows: int) -> list[int] | None:
    """Per row, the number of leading keys ``mask`` [rows or 1, 1, queries, keys] keeps, when
    that is all it does: every query of the row keeps exactly keys [0, n) and n > 0 (a
    right-padding mask); else None. Then each row's attention over its first n keys without a
    mask keeps exactly the pairs the mask keeps, padding queries included."""
    import torch

    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, rows):
        return None
    first = mask[:, 0, 0, :]  # [rows or 1, keys]: what the first query keeps
    lengths = first.sum(dim=-1)
    prefix = torch.arange(mask.shape[-1], device=mask.device) < lengths[:, None]
    if (not torch.equal(first, prefix) or not bool(lengths.all())
            or not bool((mask == first[:, None, None, :]).all())):
        return None
    return lengths.expand(rows).tolist()


def local_attention(query, key, value, mask, reach: int, scaling: float | None,
                    block_tokens: int):
    """sdpa of ``query`` [rows, heads, tokens, dim] in blocks of ``block_tokens`` queries, each
    against the ``block_tokens + 2 * reach`` keys around it with the mask's slice there (keys
    past either end are zeros the mask drops), all blocks in one call as a batch; the result is
    [rows, heads, tokens, dim]. Exact when ``mask`` keeps no pair farther apart than ``reach``."""
    import torch
    from torch.nn.functional import pad, scaled_dot_product_attention

    rows, heads, tokens, dim = query.shape
    blocks = -(-tokens // block_tokens)
    tail, width = blocks * block_tokens - tokens, block_tokens + 2 * reach
    # [rows, tokens, heads, dim] is the layout the projections wrote: blocks are views of it
    q = pad(query.transpose(1, 2), (0, 0, 0, 0, 0, tail))
    q = q.reshape(rows * blocks, block_tokens, heads, dim).transpose(1, 2)
    k, v = (pad(x.transpose(1, 2), (0, 0, 0, 0, reach, reach + tail))
            .unfold(1, width, block_tokens)  # [rows, blocks, heads, dim, width], overlapping
            .permute(0, 1, 2, 4, 3).reshape(rows * blocks, heads, width, dim)
            for x in (key, value))
    at = torch.arange(blocks, device=mask.device)[:, None] * block_tokens
    queries = (at + torch.arange(block_tokens, device=mask.device)[None]).clamp(max=tokens - 1)
    keys = at - reach + torch.arange(width, device=mask.device)[None]  # [blocks, width]
    keep = mask[:, 0][:, queries[:, :, None], keys.clamp(0, tokens - 1)[:, None, :]]
    keep = (keep & ((keys >= 0) & (keys < tokens))[None, :, None, :]).expand(
        rows, blocks, block_tokens, width).reshape(rows * blocks, 1, block_tokens, width)
    out = scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scaling)
    out = out.transpose(1, 2).reshape(rows, blocks * block_tokens, heads, dim)[:, :tokens]
    return out.transpose(1, 2)

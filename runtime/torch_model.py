"""Loading an artifact's torch module from safetensors (never a pickle)."""

from __future__ import annotations

import os

from vllm_srun.runtime import attention
from vllm_srun.runtime.errors import ArtifactError, Unsupported
from vllm_srun.runtime.precision import Precision
from vllm_srun.runtime.types import Manifest, Task

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def load_module(manifest: Manifest, precision: Precision = Precision.FLOAT32):
    """A torch module ``(input_ids, attention_mask[, token_type_ids]) -> hidden [rows, tokens,
    dim] | logits [rows, labels] | per-token logits [rows, tokens, labels]``, its weights in
    ``precision``: bfloat16 weights (measured faster than autocast at small shapes here), or
    int8 Linear layers by dynamic quantization."""
    if manifest.safetensors_path is None:
        raise Unsupported(f"model {manifest.name!r} has no safetensors weights; "
                          "the torch backend needs model.safetensors (use onnxruntime)")
    import torch
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    cls = {Task.EMBED: AutoModel, Task.CLASSIFY: AutoModelForSequenceClassification,
           Task.RERANK: AutoModelForSequenceClassification,
           Task.TOKEN_CLASSIFY: AutoModelForTokenClassification}[manifest.task]
    try:
        model = cls.from_pretrained(manifest.path, use_safetensors=True, local_files_only=True,
                                    dtype=torch.bfloat16 if precision is Precision.BFLOAT16
                                    else torch.float32)
    except Exception as exc:  # transformers raises many kinds; translate at the boundary
        raise ArtifactError(f"cannot load {manifest.path} with transformers: {exc}") from exc
    if attention.supports(model.config):  # local layers: score only the window (attention.py)
        model.set_attn_implementation(attention.register())
    model.eval()
    if precision is Precision.INT8:
        model = _quantized(torch, model)

    class Encoder(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids)
            return out.last_hidden_state if manifest.task is Task.EMBED else out.logits

    return Encoder(model).eval()


def _quantized(torch, model):
    """Linear layers with int8 weights, activations quantized per forward (fbgemm: VNNI)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated, still shipped
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear},
                                                      dtype=torch.qint8)

"""Request options that peers' clients send (R7.5), read the same way on every route family
(ours under ``/v1``, text-embeddings-inference's, infinity's): the model's prompts, whether a
vector is L2-normalized, Matryoshka ``dimensions``, the truncation direction and raw scores.

Each is a small pure function of the deployment's :class:`ModelInfo` and the request's value:
it either names what the front end does (a prompt to put before each input, a row operation
on the answer) or refuses with an :class:`ApiError` naming the field. The worker's answer is
the model's own (its sentence-transformers modules: a Normalize module, a CrossEncoder's
sigmoid); when a request asks for the values before that last step (``normalize: false`` on
a normalizing model, ``raw_scores`` on a sigmoid head) the rows are asked for ``raw``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_srun.runtime.pooling import l2_normalize
from vllm_srun.server.frontend.errors import ApiError
from vllm_srun.server.pool.deployment_pool import ModelInfo

DIRECTIONS = ("right", "left", "Right", "Left")


@dataclass(frozen=True)
class EmbedOptions:
    """What an embeddings request asks beyond its texts. ``normalize`` None: as the model's
    own modules say (OpenAI's, infinity's routes); text-embeddings-inference sends True by
    default."""

    normalize: bool | None = None
    dimensions: int | None = None
    prompt_name: str | None = None


@dataclass(frozen=True)
class VectorPlan:
    """How the front end turns the worker's rows into the answer."""

    raw: bool  # ask the worker for pooled vectors before the model's Normalize module
    dimensions: int | None  # keep the first N (Matryoshka), None: all
    normalize: bool  # L2-normalize each row here (after cutting)


def prompt_of(info: ModelInfo, prompt_name: str | None) -> str:
    """The text put before each input: the named prompt of the model's sentence-transformers
    config, else its ``default_prompt_name``'s, else none. An unknown name is refused with
    the known ones listed."""
    manifest = info.manifest
    prompts = dict(manifest.prompts) if manifest is not None else {}
    if prompt_name is None:
        default = manifest.default_prompt_name if manifest is not None else None
        return prompts[default] if default is not None else ""
    if prompt_name not in prompts:
        known = (f"its prompts are {sorted(prompts)}" if prompts else
                 "it declares no prompts (config_sentence_transformers.json)")
        raise ApiError("invalid_request", f"prompt_name {prompt_name!r} is not a prompt of "
                                          f"model {info.name!r}: {known}")
    return prompts[prompt_name]


def with_prompt(texts: Sequence[str], prompt: str) -> list[str]:
    return [prompt + t for t in texts] if prompt else list(texts)


def check_direction(direction: str, truncate: bool) -> None:
    """Inputs are cut on the right (sentence-transformers' way); ``Left`` is refused where it
    would change the answer (when ``truncate`` is on)."""
    if direction.lower() == "left" and truncate:
        raise ApiError("unsupported", "truncation_direction 'Left' is not supported: inputs "
                                      "are cut on the right; send 'Right' or leave it out")


def vector_plan(info: ModelInfo, options: EmbedOptions) -> VectorPlan:
    """The plan for an embeddings request, or an ApiError naming ``dimensions``.

    ``dimensions`` is allowed on every embedder, as OpenAI and text-embeddings-inference
    allow it: it is meaningful on Matryoshka-trained models, and nothing in a model's files
    says reliably which are. A cut vector is L2-normalized again when the full one would be
    normalized (the model's Normalize module, or ``normalize: true``)."""
    hidden = info.hidden_size
    dims = options.dimensions
    if dims is not None and (dims < 1 or (hidden and dims > hidden)):
        bound = f"between 1 and {hidden}, the hidden size of {info.name!r}" if hidden \
            else "at least 1"
        raise ApiError("invalid_request", f"dimensions must be {bound}, got {dims}")
    model_normalizes = info.manifest.normalize if info.manifest is not None else None
    want = options.normalize if options.normalize is not None else bool(model_normalizes)
    if not want and model_normalizes is None and options.normalize is not None:
        raise ApiError("unsupported", f"normalize: false: deployment of {info.name!r} is "
                                      "served by attached endpoints only, whose vectors are "
                                      "answered as they normalize them")
    cut = dims is not None and hidden is not None and dims < hidden
    raw = bool(model_normalizes) and not want
    return VectorPlan(raw, dims if cut else None, want and (cut or not model_normalizes))


def apply_plan(vectors: np.ndarray, plan: VectorPlan) -> np.ndarray:
    """The worker's rows [rows, dim] as the plan says (float32)."""
    if plan.dimensions is not None:
        vectors = vectors[:, : plan.dimensions]
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    return l2_normalize(vectors) if plan.normalize else vectors


def raw_scores_wanted(info: ModelInfo, raw_scores: bool) -> bool:
    """Whether rerank rows are asked for raw (the logit before the CrossEncoder's sigmoid):
    only when the request wants raw scores and the model applies a sigmoid."""
    if raw_scores and info.manifest is None:
        raise ApiError("unsupported", f"raw_scores: deployment of {info.name!r} is served by "
                                      "attached endpoints only, which answer scores as is")
    return raw_scores and info.manifest is not None and info.manifest.sigmoid


def class_probabilities(logits: np.ndarray, raw_scores: bool) -> np.ndarray:
    """A sequence classifier's scores: softmax over each row's logits, or the logits."""
    if raw_scores:
        return logits
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)

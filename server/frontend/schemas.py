"""Request bodies at the HTTP edge (pydantic)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_INPUTS = 2048


Direction = Literal["right", "left", "Right", "Left"]  # text-embeddings-inference's


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request, plus the fields peers' clients send (R7.5): ``truncate``,
    ``normalize``, ``prompt_name`` and ``truncation_direction``."""

    model_config = ConfigDict(extra="forbid")

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None  # range checked against the model (options.py)
    user: StrictStr | None = None  # OpenAI's end-user id: accepted, not used
    truncate: StrictBool = False
    normalize: StrictBool | None = None
    prompt_name: StrictStr | None = None
    truncation_direction: Direction = "right"


class ClassifyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    truncate: StrictBool = False
    top_k: StrictInt | None = Field(default=None, ge=1)
    raw_scores: StrictBool = False  # logits instead of softmax probabilities
    truncation_direction: Direction = "right"


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: StrictStr


class RerankBody(BaseModel):
    """A rerank request as Cohere, Jina, infinity and text-embeddings-inference clients send
    it (R7.4): documents are strings or ``{"text": ...}`` objects."""

    model_config = ConfigDict(extra="forbid")

    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    model: StrictStr | None = None
    top_n: StrictInt | None = Field(default=None, ge=1)
    return_documents: StrictBool = False
    truncate: StrictBool = False
    raw_scores: StrictBool = False  # the logit, before the CrossEncoder's sigmoid
    truncation_direction: Direction = "right"

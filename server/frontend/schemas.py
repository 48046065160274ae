"""Request bodies at the HTTP edge (pydantic)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_INPUTS = 2048


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request, plus ``truncate``."""

    model_config = ConfigDict(extra="forbid")

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None
    truncate: StrictBool = False


class ClassifyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    truncate: StrictBool = False
    top_k: StrictInt | None = Field(default=None, ge=1)


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

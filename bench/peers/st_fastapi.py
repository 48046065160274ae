"""Peer: sentence-transformers ``encode`` behind FastAPI, as a user would write it.

One model, torch at THREADS intra-op threads, one ``encode`` per request (run in FastAPI's
thread pool), no batching across requests.
Usage: python -m bench.peers.st_fastapi MODEL_FOLDER PORT THREADS
"""

from __future__ import annotations

import sys

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from sentence_transformers import SentenceTransformer


class Body(BaseModel):
    input: str | list[str]
    model: str | None = None


def build(folder: str, threads: int) -> FastAPI:
    torch.set_num_threads(threads)
    model = SentenceTransformer(folder, device="cpu", local_files_only=True)
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/v1/embeddings")
    def embed(body: Body):
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = model.encode(texts, convert_to_numpy=True, normalize_embeddings=True)
        return {"data": [{"index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]}

    return app


if __name__ == "__main__":
    folder, port, threads = sys.argv[1:4]
    uvicorn.run(build(folder, int(threads)), host="127.0.0.1", port=int(port),
                log_level="warning")

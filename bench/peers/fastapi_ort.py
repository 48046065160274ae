"""Peer: the FastAPI + onnxruntime server a user would write in an afternoon.

One session, no batching, one forward per request (run in FastAPI's thread pool).
Usage: python -m bench.peers.fastapi_ort ONNX_PATH TOKENIZER_JSON PORT THREADS
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from tokenizers import Tokenizer


class Body(BaseModel):
    input: str | list[str]
    model: str | None = None


def build(onnx_path: str, tokenizer_path: str, threads: int) -> FastAPI:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
    tok = Tokenizer.from_file(tokenizer_path)
    tok.no_padding()
    tok.enable_truncation(256)
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/v1/embeddings")
    def embed(body: Body):
        texts = [body.input] if isinstance(body.input, str) else body.input
        encs = tok.encode_batch(texts)
        n = max(len(e.ids) for e in encs)
        ids = np.zeros((len(encs), n), np.int64)
        mask = np.zeros((len(encs), n), np.int64)
        for i, e in enumerate(encs):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1
        (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
        m = mask[:, :, None].astype(np.float32)
        vec = (hidden * m).sum(1) / m.sum(1)
        vec /= np.linalg.norm(vec, axis=1, keepdims=True)
        return {"data": [{"index": i, "embedding": v.tolist()} for i, v in enumerate(vec)]}

    return app


if __name__ == "__main__":
    onnx_path, tokenizer_path, port, threads = sys.argv[1:5]
    uvicorn.run(build(onnx_path, tokenizer_path, int(threads)), host="127.0.0.1",
                port=int(port), log_level="warning")

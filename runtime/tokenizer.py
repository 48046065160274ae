"""Tokenization with the model's own ``tokenizer.json`` and the model's token limit.

The shipped tokenizer files may carry fixed padding/truncation; both are turned off, and
truncation (when a request asks for it) cuts exactly as sentence-transformers does:
longest-first to ``max_tokens`` including the special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as _HFTokenizer

from vllm_srun.runtime.errors import ArtifactError, InputTooLong


class Tokenizer:
    def __init__(self, path: str, max_tokens: int) -> None:
        try:
            self._plain = _HFTokenizer.from_file(path)
            self._cut = _HFTokenizer.from_file(path)
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise ArtifactError(f"cannot load tokenizer {path}: {exc}") from exc
        self._plain.no_padding()
        self._plain.no_truncation()
        self._cut.no_padding()
        self._cut.enable_truncation(max_length=max_tokens)
        self.max_tokens = max_tokens

    def encode(self, texts: Sequence[str], truncate: bool = False,
               positions: Sequence[int] | None = None) -> list[list[int]]:
        """Token ids per text. Over the limit: cut when ``truncate``, else InputTooLong
        naming the input by its position in the request (``positions[i]``, default i)."""
        encodings = self._plain.encode_batch(list(texts))
        rows = [e.ids for e in encodings]
        for i, ids in enumerate(rows):
            if len(ids) > self.max_tokens:
                if not truncate:
                    at = positions[i] if positions else i
                    raise InputTooLong(
                        f"input[{at}] has {len(ids)} tokens, more than the model's limit of "
                        f"{self.max_tokens}; shorten it or set \"truncate\": true")
                rows[i] = self._cut.encode(texts[i]).ids
        return rows

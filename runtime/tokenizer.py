"""Tokenization with the model's own ``tokenizer.json`` and the model's token limit.

The shipped tokenizer files may carry fixed padding/truncation; both are turned off, and
truncation (when a request asks for it) cuts exactly as sentence-transformers does:
longest-first to ``max_tokens`` including the special tokens. An input is a text or a text
pair (a reranker's query and document), tokenized with the tokenizer's pair template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Encoding
from tokenizers import Tokenizer as _HFTokenizer

from vllm_srun.runtime.errors import ArtifactError, InputTooLong
from vllm_srun.runtime.types import TextInput


@dataclass(frozen=True)
class TokenRows:
    """Token ids per input; ``type_ids`` per input only when the inputs are text pairs."""

    ids: list[list[int]]
    type_ids: list[list[int]] | None = None


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

    def encodings(self, inputs: Sequence[TextInput], truncate: bool = False,
                  positions: Sequence[int] | None = None,
                  field: str = "input") -> list[Encoding]:
        """The tokenizer's encodings (ids, offsets, special-token mask) per input. Over the
        limit: cut when ``truncate``, else InputTooLong naming the input as
        ``field[positions[i]]`` (default i)."""
        inputs = list(inputs)
        encodings = self._plain.encode_batch(inputs)
        for i, enc in enumerate(encodings):
            if len(enc.ids) > self.max_tokens:
                if not truncate:
                    at = positions[i] if positions else i
                    what = "with the query has" if not isinstance(inputs[i], str) else "has"
                    raise InputTooLong(
                        f"{field}[{at}] {what} {len(enc.ids)} tokens, more than the model's "
                        f"limit of {self.max_tokens}; shorten it or set \"truncate\": true")
                item = inputs[i]
                encodings[i] = (self._cut.encode(item) if isinstance(item, str)
                                else self._cut.encode(*item))
        return encodings

    def encode(self, inputs: Sequence[TextInput], truncate: bool = False,
               positions: Sequence[int] | None = None) -> list[list[int]]:
        """Token ids per input (see :meth:`encodings`)."""
        return [e.ids for e in self.encodings(inputs, truncate, positions)]

    def rows(self, inputs: Sequence[TextInput], truncate: bool = False,
             positions: Sequence[int] | None = None, field: str = "input") -> TokenRows:
        """Token ids per input, with type ids when any input is a text pair."""
        encodings = self.encodings(inputs, truncate, positions, field)
        pairs = any(not isinstance(t, str) for t in inputs)
        return TokenRows([e.ids for e in encodings],
                         [e.type_ids for e in encodings] if pairs else None)

    def plain(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[Encoding]:
        """Encodings without any limit (what a tokenize request shows)."""
        return self._plain.encode_batch(list(texts), add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Texts of token id sequences, by the tokenizer's decoder."""
        return self._plain.decode_batch([list(i) for i in ids],
                                        skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._plain.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._plain.token_to_id(token)

    def tokens_to_string(self, tokens: list[str]) -> str:
        """Tokens joined back into text as transformers' ``convert_tokens_to_string`` does
        (the tokenizer's decoder, else spaces)."""
        decoder = self._plain.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

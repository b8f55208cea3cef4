"""Text -> token ids with HF `tokenizers` from a model's tokenizer.json: no fixed padding (the runner
pads per batch), truncation to max_seq_length special tokens included, as sentence-transformers does."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class InputTooLong(ValueError):
    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(f"input {index} has {tokens} tokens, over the limit of {limit} (send truncate=true to cut it)")
        self.index, self.tokens, self.limit = index, tokens, limit


class PairIds(list):
    """A text pair's token ids, `[CLS] a [SEP] b [SEP]`, with where the second text's tokens start (token type 1 from
    there on, as the tokenizer's pair encoding says: a separator inside a text does not move it)."""

    def __init__(self, ids, second: int) -> None:
        super().__init__(ids)
        self.second = second


class TextTokenizer:
    def __init__(self, path: str | Path, max_length: int) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        self.max_length = max_length
        self._truncating = Tokenizer.from_file(str(path))
        self._truncating.no_padding()  # the MiniLM tokenizer.json pads every input to 128
        self._truncating.enable_truncation(max_length=max_length)
        self._full = Tokenizer.from_file(str(path))
        self._full.no_padding()
        self._full.no_truncation()

    def encode(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Token ids per text, [CLS] ... [SEP] included. Without truncation, too-long inputs raise InputTooLong."""
        if truncate:
            return [e.ids for e in self._truncating.encode_batch(texts)]
        ids = [e.ids for e in self._full.encode_batch(texts)]
        for index, row in enumerate(ids):
            if len(row) > self.max_length:
                raise InputTooLong(index, len(row), self.max_length)
        return ids

    @property
    def untruncated(self) -> Tokenizer:
        """The HF tokenizer without truncation or padding: token offsets (/tokenize), decoding, left-side truncation."""
        return self._full

    def encode_pairs(self, pairs: list[tuple[str, str]], truncate: bool = True) -> list[list[int]]:
        """Token ids per (a, b) pair, `[CLS] a [SEP] b [SEP]` (the model's own template), truncated longest-first
        to max_length as a cross-encoder's tokenizer call does. Without truncation, too-long pairs raise."""
        pairs = [tuple(p) for p in pairs]
        rows = [PairIds(e.ids, next((i for i, t in enumerate(e.type_ids) if t), len(e.ids)))
                for e in (self._truncating if truncate else self._full).encode_batch(pairs)]
        if not truncate:
            for index, row in enumerate(rows):
                if len(row) > self.max_length:
                    raise InputTooLong(index, len(row), self.max_length)
        return rows

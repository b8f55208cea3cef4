"""Inputs -> token-id rows, the one place text is prepared: HF `tokenizers` from a model's tokenizer.json (no fixed
padding: the runner packs per batch; truncation to max_seq_length special tokens included), and around it what
sentence-transformers does before tokenizing (the prompt before each text, lower-casing where the model says so),
text pairs for cross-encoders, token ids given by the client (checked, cut), and /tokenize's token details."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer, processors

from fusedserve.model.api import InputTooLong as _InputTooLong
from fusedserve.model.api import ColbertText, InvalidInput, PromptTemplate, Rows, TextOptions, TextSpec, Token
from fusedserve.model.config import UnsupportedModel

# the SentencePiece model files checkpoints ship beside (or instead of) tokenizer.json: DeBERTa-v3's spm.model,
# XLM-RoBERTa's sentencepiece.bpe.model, Llama's and T5's tokenizer.model
SENTENCEPIECE_FILES = ("spm.model", "sentencepiece.bpe.model", "tokenizer.model")


class InputTooLong(_InputTooLong):
    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(f"input {index} has {tokens} tokens, over the limit of {limit} (send truncate=true to cut it)")
        self.index, self.tokens, self.limit = index, tokens, limit


class PairIds(list):
    """A text pair's token ids, `[CLS] a [SEP] b [SEP]`, with where the second text's tokens start (token type 1 from
    there on, as the tokenizer's pair encoding says: a separator inside a text does not move it)."""

    def __init__(self, ids, second: int) -> None:
        super().__init__(ids)
        self.second = second


class PairTemplate(Protocol):
    """A causal LM's reranking prompt (model.family.YesNoReranker): body.format(instruction=, query=, document=)
    between prefix and suffix."""

    prefix: str
    body: str
    suffix: str
    instruction: str


def tokenizer_file(directory: str | Path) -> Path:
    """A model directory's tokenizer.json, the one tokenizer format served (HF `tokenizers`). A directory that ships
    only a SentencePiece model is refused by name: turning one into tokenizer.json is transformers' slow-to-fast
    conversion, which needs the sentencepiece package (not a dependency here), and a tokenizer rebuilt by hand would
    be one transformers does not check."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if path.is_file():
        return path
    spm = next((name for name in SENTENCEPIECE_FILES if (directory / name).is_file()), None)
    if spm is not None:
        raise UnsupportedModel(
            f"{spm} without tokenizer.json: {directory} ships its tokenizer as a SentencePiece model only, and this "
            "server reads tokenizer.json (converting needs transformers with sentencepiece and protobuf); write one "
            "beside it, e.g. AutoTokenizer.from_pretrained(dir).save_pretrained(dir), and load again")
    raise UnsupportedModel(f"{directory} has no tokenizer.json")


def eos_template(config_path: Path, tokenizer: Tokenizer) -> processors.TemplateProcessing | None:
    """The post-processor tokenizer_config.json asks for with add_eos_token: true, as transformers' LlamaTokenizerFast
    builds it from the config's flags: `<s> $A </s>` (a pair: `<s> $A </s> <s> $B </s>`), the BOS where add_bos_token
    is true or unset (that tokenizer's default). None where the config does not set add_eos_token: the tokenizer.json's
    own post-processor stands.

    The decoder embedders that pool the last token (e5-mistral, Linq-Embed-Mistral) pool that appended EOS, and their
    tokenizer.json's post-processor adds only the BOS: transformers 5 takes tokenizer.json as it is and drops the
    config's flags, which would pool the last word instead (a silently different embedding); the config is what the
    models were trained and evaluated with."""
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("add_eos_token") is not True:
        return None
    specials = config_path.parent / "special_tokens_map.json"
    named = json.loads(specials.read_text(encoding="utf-8")) if specials.is_file() else {}

    def token(key: str) -> tuple[str, int] | None:
        value = config.get(key) or named.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        index = tokenizer.token_to_id(content) if isinstance(content, str) else None
        return None if index is None else (content, index)

    eos, bos = token("eos_token"), token("bos_token")
    if eos is None:
        raise UnsupportedModel(f"{config_path}: add_eos_token is true but eos_token names no token of the "
                               f"vocabulary ({config.get('eos_token')!r})")
    if config.get("add_bos_token", True) is not True or bos is None:
        bos = None  # transformers adds no BOS where the config names none
    first, second = (f"{bos[0]}:0 ", f" {bos[0]}:1") if bos else ("", "")
    single = f"{first}$A:0 {eos[0]}:0"
    return processors.TemplateProcessing(single=single, pair=f"{single}{second} $B:1 {eos[0]}:1",
                                         special_tokens=list(dict.fromkeys(t for t in (bos, eos) if t)))


class TextTokenizer:
    def __init__(self, path: str | Path, max_length: int) -> None:
        path = Path(path)
        if path.is_dir():
            path = tokenizer_file(path)
        self.path, self.max_length = path, max_length
        loaded = Tokenizer.from_file(str(path))
        template = eos_template(path.parent / "tokenizer_config.json", loaded)
        if template is not None:
            loaded.post_processor = template
        saved = loaded.to_str()
        self._truncating = Tokenizer.from_str(saved)
        self._truncating.no_padding()  # the MiniLM tokenizer.json pads every input to 128
        self._truncating.enable_truncation(max_length=max_length)
        # the tokenizer cuts the text, not its special tokens, wherever its template puts them ([CLS] ... [SEP], a
        # decoder's trailing <|endoftext|> or </s>)
        self._left_truncating = Tokenizer.from_str(saved)
        self._left_truncating.no_padding()
        self._left_truncating.enable_truncation(max_length=max_length, direction="left")
        self._full = Tokenizer.from_str(saved)
        self._full.no_padding()
        self._full.no_truncation()
        self._template_truncating: tuple[int, Tokenizer] | None = None  # encode_between's (budget, tokenizer)

    def encodings(self, texts: list[str], truncate: bool = True, direction: str = "right") -> list:
        """The tokenizer's encodings per text, [CLS] ... [SEP] included, cut at the end (right) or the start (left) of
        the text. Without truncation, too-long inputs raise InputTooLong."""
        if truncate:
            return (self._truncating if direction == "right" else self._left_truncating).encode_batch(texts)
        encodings = self._full.encode_batch(texts)
        for index, e in enumerate(encodings):
            if len(e.ids) > self.max_length:
                raise InputTooLong(index, len(e.ids), self.max_length)
        return encodings

    def encode(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Token ids per text, [CLS] ... [SEP] included. Without truncation, too-long inputs raise InputTooLong."""
        return [e.ids for e in self.encodings(texts, truncate)]

    def special_ids(self, names: tuple[str, ...]) -> tuple[int, ...]:
        """The ids of the special tokens `names` (cls_token, eos_token, ...) as tokenizer_config.json or
        special_tokens_map.json name them, where the model has them."""
        named: dict = {}
        for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the second's names win, as transformers'
            try:
                named.update(json.loads((self.path.parent / file).read_text()))
            except (OSError, ValueError):
                continue
        ids = []
        for name in names:
            token = named.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and (found := self._full.token_to_id(token)) is not None:
                ids.append(found)
        return tuple(dict.fromkeys(ids))

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

    def encode_between(self, texts: list[str], prefix: str, suffix: str, truncate: bool = True) -> list[list[int]]:
        """prefix + text + suffix per text as a causal LM's prompt template builds it (Qwen3-Reranker's code): the
        prefix and suffix tokenized without special tokens, each text with them and truncated to what max_length
        leaves after the two. Without truncation, too-long inputs raise InputTooLong."""
        around = [e.ids for e in self._full.encode_batch([prefix, suffix], add_special_tokens=False)]
        budget = self.max_length - len(around[0]) - len(around[1])
        if budget < 1:
            raise ValueError(f"max_seq_length {self.max_length} leaves no room for a text in the prompt template "
                             f"({len(around[0]) + len(around[1])} tokens)")
        if truncate:
            if self._template_truncating is None or self._template_truncating[0] != budget:
                cutting = Tokenizer.from_str(self._full.to_str())
                cutting.enable_truncation(max_length=budget)
                self._template_truncating = (budget, cutting)
            encodings = self._template_truncating[1].encode_batch(texts)
        else:
            encodings = self._full.encode_batch(texts)
        rows = []
        for index, e in enumerate(encodings):
            if len(e.ids) > budget:
                raise InputTooLong(index, len(e.ids) + len(around[0]) + len(around[1]), self.max_length)
            rows.append(around[0] + e.ids + around[1])
        return rows


def _rows_of(encodings) -> Rows:
    """The encodings' ids as Rows, turned into arrays once, here."""
    rows = [e.ids for e in encodings]  # each .ids read builds a list: read once
    if len(rows) == 1:
        return Rows(np.array(rows[0], dtype=np.int64), np.array([len(rows[0])], dtype=np.int64))
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    return Rows(np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum())), lengths)


def cut(rows: list[list[int]], limit: int, truncate: bool, direction: str) -> list[list[int]]:
    """Token-id rows a client sent over `limit` tokens cut to it, keeping the first and last token ([CLS], [SEP])
    and dropping from the end (right) or the start (left) of the text; with truncate=False an over-long row raises
    InputTooLong."""
    out = []
    for i, row in enumerate(rows):
        if len(row) > limit:
            if not truncate:
                raise InputTooLong(i, len(row), limit)
            row = row[: limit - 1] + [row[-1]] if direction == "right" else [row[0]] + row[len(row) - limit + 1:]
        out.append(row)
    return out


class ColbertPreparation:
    """A ColBERT model's queries and documents as PyLate's ColBERT.tokenize makes them (model.api.ColbertText): the
    text (prompt, strip and lower-casing done by the caller) cut to one token less than its role's length, [CLS] and
    [SEP] counted (the tokenizer's own limit does not apply), the role's marker put after the first token, and a query
    padded with the mask id to exactly query_length where queries are expanded. Token-id rows are taken as prepared
    where their second id is a marker (it says the role), cut to the role's length."""

    def __init__(self, spec: ColbertText, path: str | Path) -> None:
        self.spec = spec
        self.query = TextTokenizer(path, spec.query_length - 1)  # the marker's slot kept free
        self.document = TextTokenizer(path, spec.document_length - 1)
        vocabulary = self.query.untruncated
        self.names = {i: vocabulary.id_to_token(i) for i in (spec.mask_id, spec.query_marker, spec.document_marker)}

    @staticmethod
    def is_document(prompt_name: str | None) -> bool:
        """The role of texts: documents for prompt_name "document", else queries (PyLate's encode: is_query=True)."""
        return prompt_name == "document"

    def texts(self, texts: list[str], document: bool, options: TextOptions) -> Rows:
        spec = self.spec
        length, marker = (spec.document_length, spec.document_marker) if document else \
            (spec.query_length, spec.query_marker)
        try:
            encodings = (self.document if document else self.query).encodings(texts, options.truncate,
                                                                                 options.direction)
        except InputTooLong as exc:  # counted with the marker, against the role's length
            raise InputTooLong(exc.index, exc.tokens + 1, length) from None
        rows = []
        for index, e in enumerate(encodings):
            ids = e.ids
            if spec.mask_id in ids:
                raise InvalidInput(f"input {index} holds the mask token {self.names[spec.mask_id]!r}, which a ColBERT "
                                   "model keeps for query expansion")
            row = ids[:1] + [marker] + ids[1:]
            if not document and spec.expansion:
                row += [spec.mask_id] * (length - len(row))
            rows.append(row)
        return Rows.of(rows)

    def ids(self, rows: list[list[int]], options: TextOptions) -> Rows:
        spec, out = self.spec, []
        for index, row in enumerate(rows):
            if len(row) < 2 or row[1] not in (spec.query_marker, spec.document_marker):
                raise InvalidInput(
                    f"input {index}: token ids for a ColBERT model are taken as prepared, so their second id must be "
                    f"the query marker {spec.query_marker} ({self.names[spec.query_marker]!r}) or the document marker "
                    f"{spec.document_marker} ({self.names[spec.document_marker]!r}); send texts to have them prepared")
            limit = spec.document_length if row[1] == spec.document_marker else spec.query_length
            if len(row) > limit:
                if not options.truncate:
                    raise InputTooLong(index, len(row), limit)
                # the first token and the marker stay, as the last token does when cutting from the right
                if options.direction == "right":
                    row = row[: limit - 1] + row[-1:]
                else:
                    row = row[:2] + row[len(row) - limit + 2:]
            out.append(row)
        return Rows.of(out)

    def details(self, texts: list[str], options: TextOptions) -> tuple[Rows, list]:
        """/tokenize: every token of each text (nothing cut, no expansion), the role's marker after the first token
        where special tokens are added."""
        document = self.is_document(options.prompt_name)
        marker = self.spec.document_marker if document else self.spec.query_marker
        encodings = self.query.untruncated.encode_batch(texts, add_special_tokens=options.special_tokens)
        rows, details = [], []
        for text, e in zip(texts, encodings):
            tokens = _tokens(text, e)
            if options.special_tokens:
                tokens.insert(1, Token(marker, self.names[marker], True, None, None))
            rows.append([t.id for t in tokens])
            details.append(tokens)
        return Rows.of(rows), details


class TextPreparation:
    """What a model does to its inputs before the encoder sees them. Thread-safe (the tokenizers release the GIL and
    keep no state between calls)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, *, lower_case: bool = False,
                 prompts: Mapping[str, str] | None = None, default_prompt_name: str | None = None,
                 pair_template: PairTemplate | None = None, colbert: ColbertText | None = None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.limit = tokenizer.max_length
        self.lower_case, self.prompts, self.default_prompt_name = lower_case, dict(prompts or {}), default_prompt_name
        self.pair_template = pair_template
        self.colbert = ColbertPreparation(colbert, tokenizer.path) if colbert is not None else None

    @classmethod
    def of(cls, spec: TextSpec) -> TextPreparation:
        """The preparation a TextSpec describes (its tokenizer file read again)."""
        return cls(TextTokenizer(spec.tokenizer, spec.max_length), spec.vocab_size, lower_case=spec.lower_case,
                   prompts=dict(spec.prompts), default_prompt_name=spec.default_prompt_name,
                   pair_template=spec.pair_template, colbert=spec.colbert)

    def spec(self) -> TextSpec:
        """This preparation as data: TextPreparation.of(spec) makes one that prepares every input the same way."""
        t = self.pair_template
        return TextSpec(str(self.tokenizer.path), self.limit, self.vocab_size, lower_case=self.lower_case,
                        prompts=tuple(self.prompts.items()), default_prompt_name=self.default_prompt_name,
                        pair_template=None if t is None else PromptTemplate(t.prefix, t.body, t.suffix, t.instruction),
                        colbert=self.colbert.spec if self.colbert is not None else None)

    def prompt(self, prompt_name: str | None) -> str:
        """The text a prompt name stands for ("" for none; the model's default prompt when not named)."""
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(self.prompts) or "none"
            raise InvalidInput(f"prompt_name {name!r} is not one of this model's prompts ({known})",
                               param="prompt_name")
        return self.prompts[name]

    def prepare(self, inputs: Sequence, options: TextOptions) -> Rows:
        """Texts, text pairs (tuples) or token-id rows, or texts and id rows mixed -> Rows, in input order."""
        if all(type(x) is str for x in inputs):  # the common request: texts only
            return self.texts(list(inputs), options)
        texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
        pairs = [(i, x) for i, x in enumerate(inputs) if isinstance(x, tuple)]
        given = [(i, x) for i, x in enumerate(inputs) if not isinstance(x, (str, tuple))]
        if pairs:
            if self.colbert is not None:
                raise InvalidInput("a ColBERT model takes texts (queries or documents) or token ids, not text pairs")
            if len(pairs) != len(inputs):
                raise InvalidInput("a batch holds texts or text pairs, not both")
            return self.pairs([x for _, x in pairs], options)
        if given and options.prompt_name is not None:
            raise InvalidInput("prompt_name applies to texts, not to token-id inputs", param="prompt_name")
        parts: list[tuple[list[int], Rows]] = []
        if texts:
            parts.append(([i for i, _ in texts], self.texts([x for _, x in texts], options)))
        if given:
            parts.append(([i for i, _ in given], self.ids([list(x) for _, x in given], options)))
        if len(parts) == 1:
            return parts[0][1]
        order = {index: (rows, k) for positions, rows in parts for k, index in enumerate(positions)}
        return Rows.gather([order[i] for i in range(len(inputs))])

    def texts(self, texts: list[str], options: TextOptions) -> Rows:
        """sentence-transformers' order: the prompt goes before each text (its tokens count toward truncation), its
        Transformer module lower-cases where the model says so, then the tokenizer adds the special tokens and
        truncates."""
        _check_unicode(texts)
        colbert = self.colbert
        if colbert is not None and options.prompt_name in ("query", "document") and \
                options.prompt_name not in self.prompts:
            prompt = ""  # the role's name, with no prompt of that name
        else:
            prompt = self.prompt(options.prompt_name)
        if prompt:
            texts = [prompt + t for t in texts]
        if colbert is not None:  # sentence-transformers' Transformer strips each text (PyLate's tokenize calls it)
            texts = [t.strip() for t in texts]
        if self.lower_case:
            texts = [t.lower() for t in texts]
        if colbert is not None and options.details:
            rows, details = colbert.details(texts, options)
            if options.max_tokens is not None and rows.tokens > options.max_tokens:
                raise _InputTooLong(f"{rows.tokens} tokens in one request; per-token output is limited to "
                                    f"{options.max_tokens}")
            return Rows(rows.ids, rows.lengths, details=details)
        if colbert is not None:
            return colbert.texts(texts, colbert.is_document(options.prompt_name), options)
        if options.details:  # /tokenize: every token, with the text it covers (in the text as prepared)
            encodings = self.tokenizer.untruncated.encode_batch(texts, add_special_tokens=options.special_tokens)
            rows = _rows_of(encodings)
            if options.max_tokens is not None and rows.tokens > options.max_tokens:
                raise _InputTooLong(f"{rows.tokens} tokens in one request; per-token output is limited to "
                                    f"{options.max_tokens}")
            return Rows(rows.ids, rows.lengths, details=[_tokens(text, e) for text, e in zip(texts, encodings)])
        return _rows_of(self.tokenizer.encodings(texts, options.truncate, options.direction))

    def pairs(self, pairs: list[tuple[str, str]], options: TextOptions) -> Rows:
        """A cross-encoder's text pairs, as its tokenizer call makes them (longest_first truncation)."""
        for pair in pairs:
            _check_unicode(pair)
        t = self.pair_template
        if t is not None:  # a causal LM's reranking prompt: one text per pair, between the template's ends
            texts = [t.body.format(instruction=t.instruction, query=a, document=b) for a, b in pairs]
            rows = self.tokenizer.encode_between(texts, t.prefix, t.suffix, options.truncate)
            return Rows.of(rows, [len(r) for r in rows])  # one text: no token of a second one
        rows = self.tokenizer.encode_pairs(pairs, truncate=options.truncate)
        return Rows.of(rows, [r.second for r in rows])

    def ids(self, rows: list[list[int]], options: TextOptions) -> Rows:
        """Token ids a client sent: each inside the vocabulary, cut as texts are."""
        for i, row in enumerate(rows):
            if not row:
                raise InvalidInput(f"input {i} is an empty token list")
            if min(row) < 0 or max(row) >= self.vocab_size:  # in C; the offender is looked up only on failure
                bad = next(t for t in row if not 0 <= t < self.vocab_size)
                raise InvalidInput(f"input {i} has token id {bad} outside the vocabulary [0, {self.vocab_size})")
        if self.colbert is not None:
            return self.colbert.ids(rows, options)
        return Rows.of(cut(rows, self.limit, options.truncate, options.direction))

    def decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        tokenizer = self.tokenizer.untruncated
        vocab = tokenizer.get_vocab_size()
        for i, row in enumerate(rows):
            if row and (min(row) < 0 or max(row) >= vocab):
                bad = next(t for t in row if not 0 <= t < vocab)
                raise InvalidInput(f"input {i} has token id {bad} outside the vocabulary [0, {vocab})", param="ids")
        return tokenizer.decode_batch([list(r) for r in rows], skip_special_tokens=skip_special_tokens)


def _tokens(text: str, encoding) -> list[Token]:
    """An encoding's tokens with UTF-8 byte offsets into `text` (text-embeddings-inference reports bytes)."""
    if text.isascii():
        to_bytes = int
    else:
        ends = [0]
        for ch in text:
            ends.append(ends[-1] + len(ch.encode("utf-8")))
        to_bytes = ends.__getitem__
    return [Token(i, tok, True, None, None) if special else Token(i, text[a:b], False, to_bytes(a), to_bytes(b))
            for i, tok, special, (a, b) in zip(encoding.ids, encoding.tokens, encoding.special_tokens_mask,
                                               encoding.offsets)]


def _check_unicode(texts: Sequence[str]) -> None:
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON parsers refuse lone surrogates ("\ud800"); a Python caller's may not
            raise InvalidInput(f"input {i} is not valid Unicode (lone surrogate)") from None

"""The one seam between the server and the models: all the server knows of a model (docs/architecture.md, "The
seam"; docs/decisions/0016-one-seam.md).

The server loads a model with `fusedserve.model.load(path, options)` and talks to it only through the members of `ServedModel`:
text and token ids become `Rows` (prepare), rows become one block of output rows (launch -> Pending), the model
says what it is (describe), the switches change its kernel path (set_fused, fall_back, reference_copy), and the model
schedules its own device work at start-up and after ready on the `Worker` the server lends it (warm_up,
run_background, time_ops). Nothing here imports the kernels or torch: a server that imports this module has loaded
no kernel code until it loads a model.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import PurePath
from typing import Literal, Protocol

import numpy as np

KINDS = ("embedding", "classifier", "sparse")

# The names the load options take, for the server's settings to offer the same choices. BACKENDS are the kernel
# layer's (fusedserve.kernels.registry; tests/model/test_load_options.py holds them equal); POOLING_MODES are
# sentence-transformers' pooling modes the model's pooling implements (model/modules.py).
DTYPES = ("auto", "float32", "float16", "bfloat16")
BACKENDS = ("auto", "triton", "cuda", "cpu", "torch")
ATTENTION_MODES = ("auto", "pad", "varlen", "fused")
PRECISIONS = ("native", "fp8")
POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")

# The batch limits' defaults, for the server's settings and for a model loaded without them: one source, so CUDA
# graphs are sized for the batches the server forms. A CPU batch's time grows with its tokens, so larger batches
# gain nothing there and only hold the next request longer.
GPU_BATCH_TOKENS = 16384
CPU_BATCH_TOKENS = 2048
BATCH_INPUTS = 64


def batch_tokens(on_gpu: bool) -> int:
    """The default of the batch's token limit on a GPU or on the CPU."""
    return GPU_BATCH_TOKENS if on_gpu else CPU_BATCH_TOKENS


class InputError(ValueError):
    """An input the model cannot take as it is; `param` names the request field where known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InputTooLong(InputError):
    """An input over the model's length limit where the request said not to truncate it."""


class InvalidInput(InputError):
    """An input the model cannot take at all: a token id outside the vocabulary, an empty token list, an unknown
    prompt name, text that is not valid Unicode."""


@dataclass(frozen=True)
class TextOptions:
    """How inputs become token ids. truncate: cut over-long inputs (False: InputTooLong). direction: the end that is
    cut ("right" or "left"; the first and last special tokens stay). prompt_name: one of the model's prompts to put
    before each text (None: the model's default prompt, if it has one). special_tokens: add [CLS]/[SEP] (only
    /tokenize turns it off). details: keep each token's text and character offsets (Rows.details) for /tokenize;
    nothing is truncated then. max_tokens: with details, the most tokens all inputs may hold together (InputTooLong
    beyond, before any detail is built)."""

    truncate: bool = True
    direction: Literal["right", "left"] = "right"
    prompt_name: str | None = None
    special_tokens: bool = True
    details: bool = False
    max_tokens: int | None = None


@dataclass(frozen=True)
class Token:
    """One token of /tokenize: its id, the text it covers (the token itself for a special token), and its UTF-8 byte
    offsets in the input as the model saw it (prompt and lower-casing applied; None for special tokens)."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class Rows:
    """Token-id rows as arrays: every row's ids back to back in `ids`, each row's length in `lengths`. For a text
    pair, `second[i]` is where the pair's second text starts within row i (token type 1 from there on); None when
    no row is a pair. What prepare() returns, what the batcher gathers from several requests, what launch() takes.
    Never written after it is made (the batcher, the verifier and the model share it); a plain slotted class, since
    one is made for every request on the event loop."""

    __slots__ = ("ids", "lengths", "second", "details", "_pieces")

    def __init__(self, ids: np.ndarray, lengths: np.ndarray, second: np.ndarray | None = None,
                 details: list[list[Token]] | None = None) -> None:
        self.ids = ids          # [tokens] int64
        self.lengths = lengths  # [n] int64, each >= 1
        self.second = second    # [n] int64 or None
        self.details = details  # TextOptions.details only
        self._pieces: list[np.ndarray] | None = None  # each row's ids, split once (gather)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def longest(self) -> int:
        return int(self.lengths.max()) if len(self.lengths) else 0

    def row(self, i: int) -> np.ndarray:
        return self._split()[i]

    def slice(self, start: int, stop: int) -> Rows:
        """Rows start..stop-1 (a batch split in halves when the device runs out of memory)."""
        begin, end = int(self.lengths[:start].sum()), int(self.lengths[:stop].sum())
        return Rows(self.ids[begin:end], self.lengths[start:stop],
                    None if self.second is None else self.second[start:stop])

    def tolist(self) -> list[list[int]]:
        return [piece.tolist() for piece in self._split()]

    def _split(self) -> list[np.ndarray]:
        if self._pieces is None:
            self._pieces = [self.ids] if len(self.lengths) == 1 else np.split(self.ids, np.cumsum(self.lengths)[:-1])
        return self._pieces

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]], second: Sequence[int | None] | None = None) -> Rows:
        """From lists of ids (tests, benchmarks, the CLI); `second`: each pair's second-text start, None for a
        single text (default: a row's own `second` attribute, as model.tokenizer.PairIds carries it)."""
        if second is None:
            second = [getattr(r, "second", None) for r in rows]
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        if any(s is not None for s in second):
            second = np.array([len(r) if s is None else s for r, s in zip(rows, second)], dtype=np.int64)
        else:
            second = None
        return cls(ids, lengths, second)

    @classmethod
    def gather(cls, picks: Sequence[tuple[Rows, int]]) -> Rows:
        """One row of each (rows, index) pair, in order: a batch made of several requests' inputs (each request's
        rows are split once, however many batches they land in)."""
        if len(picks) == 1 and len(picks[0][0]) == 1:
            return picks[0][0]
        pieces = [rows._split()[i] for rows, i in picks]
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        second = None
        if any(rows.second is not None for rows, _ in picks):
            second = np.array([len(piece) if rows.second is None else rows.second[i]
                               for (rows, i), piece in zip(picks, pieces)], dtype=np.int64)
        return cls(np.concatenate(pieces) if pieces else np.empty(0, np.int64), lengths, second)


@dataclass(frozen=True)
class PromptTemplate:
    """A causal LM reranker's prompt: body.format(instruction=, query=, document=) between prefix and suffix."""

    prefix: str
    body: str
    suffix: str
    instruction: str


@dataclass(frozen=True)
class ColbertText:
    """A ColBERT model's text side, as PyLate (pylate.models.ColBERT) prepares its inputs: the marker token put right
    after the first token ([CLS]) of each query or document, the lengths (special tokens and the marker included;
    texts are cut to one token less before the marker goes in), the mask token that pads a query to exactly
    query_length when queries are expanded (attended to as keys only with attend_expansion), and the token ids whose
    vectors a document drops (its skiplist: punctuation). A prepared row says its role by its second id (the query or
    the document marker); a query's expansion tokens are its trailing mask ids (a text holding the mask token itself is
    refused). prompt_name "document" prepares documents; None or "query" queries (PyLate's encode defaults to
    queries)."""

    query_marker: int
    document_marker: int
    mask_id: int
    query_length: int
    document_length: int
    expansion: bool = True
    attend_expansion: bool = False
    skiplist: tuple[int, ...] = ()

    def documents(self, rows: Rows) -> np.ndarray:
        """Per row, whether it is a document ([n] bool: its second id is the document marker; otherwise a query)."""
        starts = np.cumsum(rows.lengths) - rows.lengths
        second = rows.ids[np.minimum(starts + 1, max(rows.tokens - 1, 0))] if rows.tokens else np.empty(0, np.int64)
        return (rows.lengths >= 2) & (second == self.document_marker)

    def kept(self, rows: Rows) -> np.ndarray:
        """Per token, whether it has a vector ([tokens] bool): every token of a query (its expansion included), a
        document's tokens whose id is not in the skiplist ([CLS], the marker and [SEP] are kept)."""
        in_document = np.repeat(self.documents(rows), rows.lengths)
        return ~(in_document & np.isin(rows.ids, np.asarray(self.skiplist, dtype=np.int64)))

    def attended(self, rows: Rows) -> np.ndarray:
        """Per row, how many of its first tokens are attended to as keys ([n] int64): all of them, but for a query
        with expansion tokens not attended to (attend_expansion false), those before its trailing mask ids."""
        if self.attend_expansion or not self.expansion:
            return rows.lengths.copy()
        out = rows.lengths.copy()
        for i, row in enumerate(rows._split()):
            if len(row) >= 2 and row[1] == self.query_marker and row[-1] == self.mask_id:
                real = np.flatnonzero(row != self.mask_id)
                out[i] = real[-1] + 1 if len(real) else 0
        return out


@dataclass(frozen=True)
class TextSpec:
    """Everything a model does to its inputs before the encoder sees them, as data: the tokenizer file (its
    tokenizer_config.json beside it), the length limit, the vocabulary's size, lower-casing, the prompts, a
    reranker's pair template and a ColBERT model's markers, lengths and skiplist (Description.text). The model decides
    each of them at load, with its family's code and torch; a process that only prepares inputs (a front-end in front
    of the process that runs the model) makes the same preparation from it with fusedserve.model.text_side, with
    neither torch nor the weights."""

    tokenizer: str
    max_length: int
    vocab_size: int
    lower_case: bool = False
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    pair_template: PromptTemplate | None = None
    colbert: ColbertText | None = None  # a ColBERT model's markers, lengths, expansion and skiplist

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TextSpec:
        fields = json.loads(text)
        template = fields.pop("pair_template")
        colbert = fields.pop("colbert", None)
        return cls(**{**fields, "prompts": tuple(tuple(p) for p in fields["prompts"])},
                   pair_template=PromptTemplate(**template) if template is not None else None,
                   colbert=None if colbert is None else ColbertText(**{**colbert,
                                                                       "skiplist": tuple(colbert["skiplist"])}))


class OutOfDeviceMemory(RuntimeError):
    """A forward ran out of device memory (launch or Pending.rows raise it, the model's cached blocks released
    first): a smaller batch may fit where this one did not."""


class Pending(Protocol):
    """A launched forward. ready(): its result is on the host. rows(): waits for it, then all output rows as one
    block, float32 [n, width] (pooled embeddings or a classifier's logits; per-token rows for output="tokens": [tokens,
    width]). path: "fused" or "reference", the path that ran it."""

    path: str

    def ready(self) -> bool: ...

    def rows(self) -> np.ndarray: ...


# launch's outputs: rows [n, dim] of the model's kind; per-token states [tokens, hidden]; multi-vectors, BGE-M3's
# [tokens - n, dim] or a ColBERT model's [sum of multi_vector_counts, dim] (normalized, each row's back to back);
# BGE-M3's sparse weights [tokens, 1] (a token's weight where it holds its input's largest for its id, else zero:
# with the rows' ids, each input's sparse vector); "m3": BGE-M3's three from one forward in one column (split_m3)
Output = Literal["pooled", "tokens", "colbert", "sparse", "m3"]


@dataclass(frozen=True)
class Description:
    """What a model is and how it runs now. The server reads the typed fields; `info` goes into /info as it is and
    `report` into the start-up report."""

    name: str
    kind: str                      # "embedding", "classifier" or "sparse" (a SPLADE model's vocabulary-wide vectors)
    dim: int                       # output width: embedding dimensions, the number of labels, the vocabulary
    max_length: int                # longest input in tokens, special tokens included
    device: str
    labels: tuple[str, ...] = ()   # a classifier's labels
    activation: str = "identity"   # a classifier's scores from its logits (scores())
    fused: bool = False            # the fused path is on and has not fallen back
    path: str = "reference"        # "fused" while any op the model calls runs on a fused backend
    precision: str = "native"      # "fp8" while its GEMMs run in FP8 (PRECISION=fp8, not fallen back)
    kernels: Mapping[str, str] = field(default_factory=dict)  # op -> backend, for the ops a forward calls
    graphs: Mapping[str, object] = field(default_factory=dict)  # CUDA graph counters ({} without graphs)
    memory: Mapping[str, int] = field(default_factory=dict)    # bytes held on the device, by what holds them
    text: TextSpec | None = None   # how inputs become token ids, as data (prepare's rules)
    # what launch(output=...) gives: "pooled" (the kind's rows) and "tokens" (per-token states) for every model;
    # BGE-M3 adds "colbert" (normalized multi-vectors of every token after the first) and "sparse" (per-token weights);
    # a ColBERT model gives ("tokens", "colbert") only (multi_vector_counts: how many vectors each row gets)
    outputs: tuple[str, ...] = ("pooled", "tokens")
    info: Mapping[str, object] = field(default_factory=dict)   # the rest of /info's entry
    report: str = ""

    def to_json(self) -> str:
        """As JSON, for a process that does not hold the model (a front-end of an engine); info's values as JSON
        writes them (anything else as its str())."""
        fields = asdict(self)
        fields["text"] = None if self.text is None else asdict(self.text)
        return json.dumps(fields, default=str)

    @classmethod
    def from_json(cls, text: str) -> Description:
        fields = json.loads(text)
        spec = fields.pop("text")
        return cls(**{**fields, "labels": tuple(fields["labels"]), "outputs": tuple(fields["outputs"])},
                   text=None if spec is None else TextSpec.from_json(json.dumps(spec)))


def split_m3(block: np.ndarray, description: Description, rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BGE-M3's one-forward block (launch(rows, output="m3")) as (the dense head's raw rows [n, dim], the
    multi-vectors [tokens - n, width] back to back, the sparse weights [tokens, 1])."""
    flat, n, tokens = block.reshape(-1), len(rows), rows.tokens
    dense, rest = flat[: n * description.dim], flat[n * description.dim:]
    vectors, sparse = rest[: len(rest) - tokens], rest[len(rest) - tokens:]
    width = len(vectors) // (tokens - n) if tokens > n else 0
    return dense.reshape(n, description.dim), vectors.reshape(tokens - n, width), sparse.reshape(tokens, 1)


def multi_vector_counts(description: Description, rows: Rows) -> np.ndarray:
    """Per row, how many vectors launch(rows, output="colbert") gives for it ([n] int64), in the block's order: a
    ColBERT model's queries all their tokens, its documents those not in the skiplist; BGE-M3 every token after the
    first; otherwise every token."""
    colbert = description.text.colbert if description.text is not None else None
    if colbert is not None:
        if not len(rows):  # (every row holds a token: Rows' contract)
            return np.zeros(0, np.int64)
        return np.add.reduceat(colbert.kept(rows).astype(np.int64), np.cumsum(rows.lengths) - rows.lengths)
    if "colbert" in description.outputs:
        return rows.lengths - 1
    return rows.lengths.copy()


class Worker(Protocol):
    """Where a model's device work runs, lent by the server: the one thread that owns the model's device (its
    batcher's). Work runs between two batches, or only when no request is waiting."""

    def between_batches(self, fn: Callable[[], object]) -> Future: ...

    def when_idle(self, fn: Callable[[], object]) -> Future: ...


class ServedModel(Protocol):
    """The members the server uses, and no others (tests/server/test_seam.py holds the server to them)."""

    def describe(self) -> Description: ...

    def prepare(self, inputs: Sequence[str] | Sequence[tuple[str, str]] | Sequence[Sequence[int]],
                options: TextOptions) -> Rows:
        """Texts, text pairs or token-id rows -> Rows: prompts, lower-casing, special tokens and truncation as the
        model's own library does it; token ids checked against the vocabulary. Raises InputError. Thread-safe."""

    def decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]: ...

    def launch(self, rows: Rows, *, output: Output = "pooled", reference: bool = False) -> Pending:
        """Start the forward of `rows` on the worker thread, for one of the model's `Description.outputs`;
        reference=True runs this one batch on the torch reference (a fused forward that failed), the path staying
        as it is."""

    def time_ops(self, rows: Rows, callback: Callable[[str, str, float], None]) -> Iterator[None]:
        """The eager forward of `rows` with every op timed, one block per step; callback(op, backend, seconds)."""

    def set_fused(self, enabled: bool) -> Description: ...

    def fall_back(self, reason: str) -> tuple[str, ...]:
        """Every op on the reference from the next forward on; returns the ops that moved."""

    def fall_back_precision(self, reason: str) -> bool:
        """PRECISION=fp8's fallback tier: the GEMMs back in the model's dtype on its fused path from the next forward
        on; False where FP8 was not running. set_fused clears it, as it clears fall_back."""

    def reference_copy(self) -> ServedModel:
        """An fp32 copy on the torch reference, for a background thread's checks."""

    def warm_up(self, worker: Worker, progress: Callable[[str, float | None], None]) -> dict[str, float]:
        """Before ready: compile, tune and capture what traffic will meet, on `worker`; progress(phase, fraction).
        Returns seconds per phase."""

    def run_background(self, worker: Worker) -> None:
        """After ready: the model's own work while idle (the rest of the CUDA graphs), and its watch for kernels
        compiled or tuned after ready; returns at once."""

    def stop(self) -> None:
        """Stop the background work (shutdown)."""


MEMBERS = ("describe", "prepare", "decode", "launch", "time_ops", "set_fused", "fall_back", "fall_back_precision",
           "reference_copy", "warm_up", "run_background", "stop")


@dataclass(frozen=True)
class LoadOptions:
    """How to load and run a model: device ("auto", "cpu", "cuda", "cuda:N"), dtype ("auto", "float32", "float16",
    "bfloat16"), the fused path and its backends, the longest input and pooling overrides, the attention mode, CUDA
    graphs and the batch limits they are sized for, how many graphs to capture before ready (None: none ahead of
    traffic), the kernels' cache directory (compiled kernels, tuning; None: the kernel layer's default), and the
    GEMMs' precision ("native": the dtype's; "fp8": E4M3 on FP8 tensor cores, refused where they are missing)."""

    device: str = "auto"
    dtype: str = "auto"
    fused: bool = True
    backend: str = "auto"
    backend_overrides: Mapping[str, str] = field(default_factory=dict)
    max_seq_length: int | None = None
    pooling: str | None = None
    attention: str = "auto"
    cuda_graphs: bool = True
    max_batch_tokens: int | None = None  # None: batch_tokens() of the device the model loads on
    max_batch: int = BATCH_INPUTS
    max_graphs: int = 256
    graphs_before_ready: int | None = None
    cache_dir: str | None = None
    precision: str = "native"


def name_of(path: str) -> str:
    """The name a model at `path` is served under when none is configured, known before it loads."""
    return "all-MiniLM-L6-v2" if path == "default" else PurePath(path).name


def l2_normalize(rows: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (norms floored at 1e-12, as torch.nn.functional.normalize): the one normalization
    of embeddings, wherever they are normalized."""
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def scores(logits: np.ndarray, activation: str) -> np.ndarray:
    """A classifier's scores from its logits [n, labels], as its activation says (Description.activation)."""
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if activation == "softmax":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)
    return logits

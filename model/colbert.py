"""ColBERT models as PyLate (pylate.models.ColBERT) saves and runs them: one normalized vector per token of a query or
a document, compared by MaxSim (late interaction) by whoever holds them.

A directory is a ColBERT model when config_sentence_transformers.json says model_type "ColBERT", modules.json holds
PyLate's Dense (or sentence-transformers' Dense after a Transformer and no Pooling), or config.json names Stanford's
HF_ColBERT. Read from it as PyLate reads it: the Dense projection(s) (identity activation; Stanford's linear.weight),
the query and document markers, the lengths, query expansion and whether it is attended to, the skiplist, each with
PyLate's default where the files lack it. The text side (model.api.ColbertText,
model.tokenizer.ColbertPreparation) puts the marker after [CLS] and pads expanded queries with the mask token; the
forward here runs the encoder over every token, projects each row's kept tokens (a document's skiplist dropped) and
normalizes each vector in float32. A query whose expansion tokens are not attended to (PyLate's attention mask 0 on
them: computed as queries, never attended to as keys) runs through the padded layout with that key mask, since the
packed layout attends every token of a sequence; every other row runs packed."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve.model.api import ColbertText, InputError, Rows
from fusedserve.model.config import UnsupportedModel
from fusedserve.model.modules import Dense, _json, _module_kind, linear_of, read_dense

if TYPE_CHECKING:
    from fusedserve.model.forwards import Forwards
    from fusedserve.model.tokenizer import TextTokenizer

IDENTITY = "torch.nn.modules.linear.Identity"
PYLATE_DENSE = "pylate.models.Dense.Dense"
STANFORD_LINEAR = "linear.weight"  # a Stanford checkpoint's projection, beside its bert.* tensors
OUTPUTS = ("tokens", "colbert")  # what launch gives for a ColBERT model (Description.outputs)


@dataclass(frozen=True)
class Colbert:
    """What a ColBERT directory says, with PyLate's defaults (pylate/models/colbert.py) for what it leaves out."""

    dense: tuple[Dense, ...]
    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    expansion: bool = True  # do_query_expansion
    attend_expansion: bool = False  # attend_to_expansion_tokens (false whenever expansion is)
    skiplist_words: tuple[str, ...] = field(default_factory=lambda: tuple(string.punctuation))
    head_tensors: tuple[str, ...] = ()  # the encoder checkpoint's tensors that are the projection's (Stanford's)

    @property
    def longest(self) -> int:
        return max(self.query_length, self.document_length)


def is_colbert(path: Path) -> bool:
    """Whether the directory at `path` is a ColBERT model (PyLate's or Stanford's layout)."""
    st = _json(path / "config_sentence_transformers.json") if (path / "config_sentence_transformers.json").is_file() \
        else {}
    modules = _json(path / "modules.json") if (path / "modules.json").is_file() else []
    hf = _json(path / "config.json") if (path / "config.json").is_file() else {}
    kinds = [_module_kind(m) for m in modules]
    pylate = any(m.get("type", "") == PYLATE_DENSE for m in modules)
    dense_without_pooling = bool(kinds) and kinds[0] == "Transformer" and "Dense" in kinds and "Pooling" not in kinds
    stanford = (hf.get("architectures") or [None])[0] == "HF_ColBERT"
    return st.get("model_type") == "ColBERT" or pylate or dense_without_pooling or stanford


def read_colbert(path: Path) -> Colbert | None:
    """The ColBERT model of a directory, None where it is not one (is_colbert): PyLate's layout (modules.json's Dense
    modules, config_sentence_transformers.json's settings) or Stanford's (HF_ColBERT: the projection as linear.weight
    beside the encoder's bert.* tensors, the settings in artifact.metadata), as pylate.models.ColBERT reads each. A
    ColBERT directory with neither (PyLate would append a randomly initialised projection) is refused by name."""
    if not is_colbert(path):
        return None
    modules = _json(path / "modules.json") if (path / "modules.json").is_file() else []
    dense = _dense_modules(path, modules)
    st = _json(path / "config_sentence_transformers.json") if (path / "config_sentence_transformers.json").is_file() \
        else {}
    settings = {key: value for key, value in st.items() if value is not None}  # read only where present
    head_tensors: tuple[str, ...] = ()
    if not dense:
        hf = _json(path / "config.json") if (path / "config.json").is_file() else {}
        if (hf.get("architectures") or [None])[0] != "HF_ColBERT":
            raise UnsupportedModel(
                f"{path}: a ColBERT model without a Dense module in modules.json: PyLate would append a randomly "
                "initialised projection, so its vectors could not be reproduced")
        dense, stanford = _stanford(path)
        settings.update(stanford)
        head_tensors = (STANFORD_LINEAR,)
    default = Colbert(dense)
    expansion = bool(settings.get("do_query_expansion", default.expansion))
    colbert = Colbert(dense, str(settings.get("query_prefix", default.query_prefix)),
                      str(settings.get("document_prefix", default.document_prefix)),
                      int(settings.get("query_length", default.query_length)),
                      int(settings.get("document_length", default.document_length)), expansion,
                      expansion and bool(settings.get("attend_to_expansion_tokens", default.attend_expansion)),
                      tuple(map(str, settings.get("skiplist_words", default.skiplist_words))), head_tensors)
    if not colbert.query_prefix or not colbert.document_prefix:
        raise UnsupportedModel(f"{path}: a ColBERT model without a query or document prefix is not supported (the "
                               "marker after [CLS] says whether a row is a query or a document)")
    if colbert.query_prefix == colbert.document_prefix:
        raise UnsupportedModel(f"{path}: query_prefix and document_prefix are both {colbert.query_prefix!r}; the "
                               "marker after [CLS] says whether a row is a query or a document")
    for name in ("query_length", "document_length"):
        if getattr(colbert, name) < 3:
            raise UnsupportedModel(f"{path}: {name} {getattr(colbert, name)} leaves no room for [CLS], the marker and "
                                   "[SEP]")
    return colbert


def _stanford(path: Path) -> tuple[tuple[Dense, ...], dict]:
    """A Stanford (HF_ColBERT) directory's projection, linear.weight without a bias (Dense.from_stanford_weights),
    and its settings from artifact.metadata under PyLate's names; an unreadable metadata file gives the [unused0] /
    [unused1] markers and the default lengths, as in PyLate."""
    from safetensors import safe_open

    weights = path / "model.safetensors"
    if not weights.is_file():
        raise UnsupportedModel(f"{path}: a Stanford ColBERT checkpoint without model.safetensors (only safetensors "
                               "checkpoints are supported)")
    with safe_open(str(weights), "pt") as f:
        if STANFORD_LINEAR not in f.keys():
            raise UnsupportedModel(f"{path}: a Stanford ColBERT checkpoint (HF_ColBERT) without {STANFORD_LINEAR}, "
                                   "its projection")
        weight = f.get_tensor(STANFORD_LINEAR).float()
    try:
        metadata = json.loads((path / "artifact.metadata").read_text())
    except (OSError, ValueError):
        metadata = {}
    settings = {"query_prefix": metadata.get("query_token_id", "[unused0]"),
                "document_prefix": metadata.get("doc_token_id", "[unused1]")}
    for theirs, ours in (("query_maxlen", "query_length"), ("doc_maxlen", "document_length"),
                         ("attend_to_mask_tokens", "attend_to_expansion_tokens")):
        if metadata.get(theirs) is not None:
            settings[ours] = metadata[theirs]
    return (Dense(weight, None, "identity"),), settings


def _dense_modules(path: Path, modules: list[dict]) -> tuple[Dense, ...]:
    """The Dense modules after the Transformer, in order; PyLate keeps only those (and the Transformer): a Pooling or
    Normalize module is dropped, as PyLate drops it."""
    dense = []
    for i, module in enumerate(modules):
        kind, name, where = _module_kind(module), module.get("type", ""), path / module.get("path", "")
        if i == 0:
            if kind != "Transformer":
                raise UnsupportedModel(f"modules.json: the first module is {name!r}, not a Transformer")
        elif kind == "Dense" or name == PYLATE_DENSE:
            default = IDENTITY if name == PYLATE_DENSE else "torch.nn.modules.activation.Tanh"
            activation = _json(where / "config.json").get("activation_function", default)
            if activation != IDENTITY:
                raise UnsupportedModel(f"{where}: Dense activation {activation!r} is not supported in a ColBERT model "
                                       f"(only {IDENTITY})")
            dense.append(read_dense(where, default))
        elif kind not in ("Pooling", "Normalize"):
            raise UnsupportedModel(f"modules.json: module {name!r} is not supported in a ColBERT model (Transformer "
                                   "and Dense modules only)")
    return tuple(dense)


def colbert_text(colbert: Colbert, tokenizer: TextTokenizer, vocab_size: int) -> ColbertText:
    """The text side's ids, looked up as PyLate does: the markers and skiplist words as whole tokens (a word that is
    no token: the unknown token's id), the mask token as the pad and expansion id."""
    vocabulary = tokenizer.untruncated

    def marker(prefix: str, role: str) -> int:
        found = vocabulary.token_to_id(prefix)
        if found is None or found >= vocab_size:
            raise UnsupportedModel(f"the tokenizer has no token {prefix!r} ({role}_prefix) inside the encoder's "
                                   f"{vocab_size} embeddings: PyLate would add it with a new, randomly initialised "
                                   "embedding")
        return found

    mask = tokenizer.special_ids(("mask_token",))
    if not mask:
        raise UnsupportedModel("a ColBERT model's tokenizer without a mask token is not supported (its id pads and "
                               "expands queries)")
    unknown = tokenizer.special_ids(("unk_token",))
    skiplist = {vocabulary.token_to_id(word) for word in colbert.skiplist_words}
    if None in skiplist:
        skiplist = (skiplist - {None}) | set(unknown)
    return ColbertText(marker(colbert.query_prefix, "query"), marker(colbert.document_prefix, "document"), mask[0],
                       colbert.query_length, colbert.document_length, colbert.expansion, colbert.attend_expansion,
                       tuple(sorted(skiplist)))


class ColbertHead(nn.Module):
    """The Dense projection(s) in float32 over per-token states; vectors(): each row's kept tokens, projected and
    L2-normalized (float32, eps 1e-12, as PyLate's encode). forward() fills the pooled slot that the warm-up's and
    the CUDA-graph machinery's forwards expect (the first token's projection): a ColBERT model never serves it."""

    ops: tuple[str, ...] = ()

    def __init__(self, colbert: Colbert, text: ColbertText, hidden: int) -> None:
        super().__init__()
        self.text = text
        self.dense = nn.ModuleList()
        width = hidden
        for d in colbert.dense:
            if d.weight.shape[1] != width:
                raise UnsupportedModel(f"ColBERT Dense takes {d.weight.shape[1]} features, the encoder (or the Dense "
                                       f"before) gives {width}")
            self.dense.append(linear_of(d))
            width = d.weight.shape[0]
        self.dim = width

    def project(self, x: Tensor) -> Tensor:
        # x [rows, hidden] -> [rows, dim] float32
        x = x.float()
        for layer in self.dense:
            x = F.linear(x, layer.weight.float(), None if layer.bias is None else layer.bias.float())
        return x

    def vectors(self, hidden: Tensor, rows: Rows) -> Tensor:
        # hidden [rows.tokens, hidden], each row's tokens back to back -> [kept tokens, dim] float32, normalized
        keep = torch.from_numpy(self.text.kept(rows)).to(hidden.device)
        return F.normalize(self.project(hidden[keep]), dim=-1, eps=1e-12)

    def forward(self, hidden: Tensor, p) -> Tensor:
        return self.project(hidden.index_select(0, p.cu_seqlens[:-1].long().clamp(max=hidden.shape[0] - 1)))

    def forward_padded(self, hidden: Tensor, mask: Tensor) -> Tensor:
        return self.project(hidden[:, 0])


def token_states(forwards: Forwards, text: ColbertText, rows: Rows) -> Tensor:
    """Per-token states [rows.tokens, hidden] on the device (the encoder's dtype), rows back to back: queries whose
    expansion tokens are not attended to through the padded layout with those keys masked, the rest packed."""
    attended = text.attended(rows)
    masked = np.flatnonzero(attended < rows.lengths)
    if not len(masked):
        return forwards.token_states(rows, lambda hidden, packed: hidden)
    plain = np.flatnonzero(attended == rows.lengths)
    states = forwards.masked_states(Rows.gather([(rows, int(i)) for i in masked]), attended[masked])
    if not len(plain):
        return states
    hidden = states.new_empty((rows.tokens, states.shape[1]))
    starts = np.cumsum(rows.lengths) - rows.lengths

    def positions(picked: np.ndarray) -> Tensor:
        return torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i] + rows.lengths[i]) for i in picked]))

    hidden[positions(masked).to(hidden.device)] = states
    hidden[positions(plain).to(hidden.device)] = forwards.token_states(
        Rows.gather([(rows, int(i)) for i in plain]), lambda h, packed: h)
    return hidden


@torch.inference_mode()
def launch(forwards: Forwards, head: ColbertHead, rows: Rows, output: str, name: str) -> Tensor:
    """A ColBERT model's output block on the CPU, float32: "colbert" [sum of api.multi_vector_counts, dim] (each
    row's vectors back to back), "tokens" [rows.tokens, hidden] (the encoder's per-token states, as the vectors see
    them). Any other output raises InputError naming these."""
    if output not in OUTPUTS:
        raise InputError(f"model {name} is a ColBERT model: it gives {' and '.join(map(repr, OUTPUTS))} (one vector "
                         f"per token), no {output!r} output", param="output")
    if not len(rows):
        return torch.empty(0, head.dim if output == "colbert" else forwards.config.hidden_size)
    hidden = token_states(forwards, head.text, rows)
    return (head.vectors(hidden, rows) if output == "colbert" else hidden.float()).cpu()

"""What an architecture family declares. Each family is one file (model/bert.py: BERT, RoBERTa / XLM-RoBERTa,
DistilBERT) that builds its layers from `fusedserve.kernels` ops and declares, in one `Family` per config.json
model type, everything the rest of the model package asks of an architecture: how to read its config.json, where
its weights live in a checkpoint, its classification head, the kernels its forward calls, and what it needs
(pooling of a plain Hugging Face directory, attention kind, position scheme). model/families.py is the table of
families; nothing else in the model package, and nothing in the server, branches on the architecture."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from fusedserve.model.config import EncoderConfig, UnsupportedModel


@dataclass(frozen=True)
class WeightLayout:
    """Checkpoint tensor names (after prefix stripping) -> the family's parameter names. `{i}.` follows
    layer_prefix; the query, key and value projections are stacked into one `qkv` matrix (their biases where the
    checkpoint has them). A checkpoint without the token type table (`embeddings.token_type_embeddings`) gets one
    all-zero row. Names in `optional` may be absent: the encoder built from the config says whether it needs them
    (ModernBERT's first layer has no attention norm; its norms have biases only where the config says so)."""

    embeddings: Mapping[str, str]  # tensors outside the layers
    layer_prefix: str
    layer: Mapping[str, str]
    qkv: tuple[str, ...]  # the three projections' names under the layer prefix, before ".weight"/".bias"; none
    # where the checkpoint's own name for the stacked matrix is in `layer`
    # a layer's parameter stacked from several checkpoint tensors along their first dimension (GTE's gate and up
    # projections: one GEMM)
    stacked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # a checkpoint saved in another layout (a model's Hub layout with fused projections) -> these names; applied
    # after prefix stripping, before the maps above
    rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    optional: frozenset[str] = frozenset()  # names of `embeddings` and `layer` a checkpoint may lack
    token_types: bool = True  # the encoder has a token type table (none in a decoder's: Qwen's)


def released_layer_names(tensors: dict[str, torch.Tensor], layer_prefix: str, fused_qkv: str,
                         renames: Mapping[str, str], halves: Mapping[str, tuple[str, str]] | None = None
                         ) -> dict[str, torch.Tensor]:
    """A checkpoint in the layout its custom code releases it (GTE's, NomicBERT's) -> transformers' names, as its
    conversion at load does: `{layer_prefix}{i}.` becomes `layers.{i}.`, the fused query/key/value matrix
    `fused_qkv` (weight and bias) is cut into self_attn.q_proj / k_proj / v_proj, a name starting with a key of
    `renames` gets that key replaced, and a tensor named in `halves` is cut into its two named halves along the first
    dimension. Names outside the layers pass."""
    out = {}
    for name, t in tensors.items():
        if not name.startswith(layer_prefix):
            out[name] = t
            continue
        i, rest = name[len(layer_prefix):].split(".", 1)
        base = f"layers.{i}."
        if rest.startswith(fused_qkv):
            kind = rest.rsplit(".", 1)[1]
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0)):
                out[f"{base}self_attn.{part}.{kind}"] = chunk
        elif halves and rest in halves:
            for half, chunk in zip(halves[rest], t.chunk(2, dim=0)):
                out[base + half] = chunk
        else:
            old = next((o for o in renames if rest.startswith(o)), None)
            out[base + (renames[old] + rest[len(old):] if old else rest)] = t
    return out


@dataclass(frozen=True)
class ClassifierHead:
    """A `*ForSequenceClassification` head by checkpoint name: `first` (a dense layer) on the first token, its
    activation, then the output layer `second`. ModernBERT's also pools as config.json's `pooling_key` says (cls or
    mean) and norms after the activation (`norm`, a LayerNorm)."""

    first: str
    activation: str  # tanh | relu | gelu
    second: str
    norm: str | None = None
    pooling_key: str | None = None


@dataclass(frozen=True)
class YesNoReranker:
    """A causal LM served as a reranker (Qwen3-Reranker's documented use): each (query, document) pair is written
    into `body`, truncated to what max_seq_length leaves after `prefix` and `suffix` (tokenized without special
    tokens), and the score is the probability of `yes` against `no` as the next token: softmax over the two LM-head
    logits at the last position, sigmoid(yes - no); only those two rows of the LM head are computed."""

    prefix: str
    body: str  # str.format fields: instruction, query, document
    suffix: str
    instruction: str  # the default task
    yes: str = "yes"
    no: str = "no"


@dataclass(frozen=True)
class MaskedLMHead:
    """A `*ForMaskedLM` head by checkpoint name: dense -> GELU -> LayerNorm (`transform`, `norm`), then the decoder
    onto the vocabulary (its weight tied to the word embeddings where the checkpoint has none) plus `bias`. What a
    SPLADE model's sparse vectors are made from (model/modules.py, SparseHead)."""

    transform: str
    norm: str
    decoder: str
    bias: str


@dataclass(frozen=True)
class Family:
    name: str                      # EncoderConfig.architecture
    model_types: tuple[str, ...]   # config.json model_type values it serves
    label: str                     # for messages: "RoBERTa / XLM-RoBERTa"
    read_config: Callable[[dict], dict]  # config.json -> EncoderConfig fields (raises UnsupportedModel)
    weights: WeightLayout
    classifier: ClassifierHead | None  # None: its sequence classifiers are refused by name
    encoder: Callable[[EncoderConfig], nn.Module]  # the layers, randomly initialised
    # (layout, attention, device, dtype) -> the kernels.* ops a forward calls: the registry tests and races these
    kernel_ops: Callable[[str, str, torch.device, torch.dtype], tuple[str, ...]]
    pooling: tuple[str, ...] = ("mean",)  # a plain Hugging Face directory's pooling (no modules.json)
    attention: str = "bidirectional"
    positions: str = "learned absolute"
    # the few-token layer (model.packing.FEW_TOKEN_OPS) exists in its layers: auto attention may pick "fused"
    few_token_layer: bool = True
    masked_lm: MaskedLMHead | None = None  # None: its SPLADE (sparse) models are refused by name
    reranker: YesNoReranker | None = None  # None: its *ForCausalLM directories are refused by name
    gated_ffn: bool = False  # the FFN-in projects to 2 x intermediate_size (a gate and an up half)
    # its encoder runs PRECISION=fp8: quantize_fp8() and an fp8_weights / precision pair its packed forward follows
    fp8: bool = False
    # the dtype DTYPE=auto serves on a GPU: decoder LLMs are trained and shipped in bfloat16, and their residual
    # streams can outgrow float16's range
    dtype_on_cuda: torch.dtype = torch.float16
    # the dtypes it is served in (DTYPE names another: refused before its weights load, naming these and `why`)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    dtypes_why: str = ""

    def describe(self) -> str:
        return f"{self.label}: {self.attention} attention, {self.positions} positions"

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raises UnsupportedModel where the family is not served in `dtype`."""
        if dtype not in self.dtypes:
            names = " and ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            why = f" ({self.dtypes_why})" if self.dtypes_why else ""
            raise UnsupportedModel(f"dtype {str(dtype).removeprefix('torch.')} is not supported by {self.label}: it "
                                   f"is served in {names}{why}")

"""What a model directory asks of the encoder's output, read from its own files, and the heads that do it.

Embedding models: the sentence-transformers pipeline (modules.json: Transformer, Pooling, Dense..., Normalize;
1_Pooling/config.json; config_sentence_transformers.json's prompts; sentence_bert_config.json's max_seq_length and
do_lower_case). A module or pooling mode not implemented here stops the load with an error naming it: a vector is
either sentence-transformers' or none. A plain Hugging Face directory (no modules.json) is mean-pooled, the documented
default, unless `pooling=` says otherwise.

Sparse models (sentence-transformers' SparseEncoder: modules.json MLMTransformer + SpladePooling, as SPLADE ships):
the family's masked-LM head over every token, log(1 + relu(logit)) and the max over each input's tokens: one
vocabulary-wide vector per input, most of it zero (SparseHead; the [tokens, vocabulary] logits are never written).

BGE-M3 (FlagEmbedding's M3Embedder: colbert_linear.pt and sparse_linear.pt beside the checkpoint): the dense vector
is the sentence-transformers pipeline's (CLS, normalized); the same forward's per-token states also give the
multi-vector output (colbert_linear over every token after the first, each row normalized) and the sparse one
(ReLU(sparse_linear) a token's weight, each token id's largest weight kept, special tokens dropped): M3Head.

ColBERT models (PyLate's layout: modules.json Transformer then Dense, config_sentence_transformers.json model_type
"ColBERT"): read by model.colbert into Pipeline.colbert, which takes the place of pooling (one vector per token).

Classifiers (config.json architectures `*ForSequenceClassification`): the architecture's own head on the first token
(the family's ClassifierHead: BERT pooler + tanh + classifier, DistilBERT pre_classifier + ReLU + classifier, ...),
logits out; the activation (sigmoid for one label, softmax otherwise, or what config.json's sentence_transformers
section names) is applied by whoever serves the scores.

Heads run on the packed layout's hidden states [T, hidden] (and, for tests, the padded one) and return float32
[batch, dim] on the device; they are captured in the CUDA graphs with the encoder.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.model.api import POOLING_MODES
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.families import family
from fusedserve.model.family import ClassifierHead, YesNoReranker
from fusedserve.model.weights import MASKED_LM

if TYPE_CHECKING:
    from fusedserve.model.colbert import Colbert

_LEGACY_POOLING = {  # sentence-transformers' pooling_mode_* flags, in its order of concatenation
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST = "sentence_transformers.models."
_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
SCORE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
                     "torch.nn.modules.activation.Softmax": "softmax"}


@dataclass(frozen=True)
class Dense:
    weight: Tensor  # [out, in]
    bias: Tensor | None
    activation: str  # identity | tanh


@dataclass(frozen=True)
class Sparse:
    """A SPLADE model's head (SparseEncoder's SpladePooling over its MLMTransformer's logits): activation "relu"
    (log(1 + relu(x)), every SPLADE model's) or "log1p_relu" (one more log1p, OpenSearch's), max over the tokens.
    tensors: the masked-LM head's (transform.weight / .bias, norm.weight / .bias, decoder.bias and, unless tied to
    the word embeddings, decoder.weight), set by masked_lm_tensors once the checkpoint is read."""

    activation: str = "relu"
    tensors: Mapping[str, Tensor] = field(default_factory=dict)
    norm_eps: float = 1e-12


_SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class M3Heads:
    """BGE-M3's two heads beside its dense output, as FlagEmbedding saves them (torch state dicts of Linear layers):
    colbert [dim, hidden] + [dim], sparse [1, hidden] + [1]."""

    colbert_weight: Tensor
    colbert_bias: Tensor
    sparse_weight: Tensor
    sparse_bias: Tensor


M3_FILES = ("colbert_linear.pt", "sparse_linear.pt")
M3_DROPPED = ("cls_token", "eos_token", "pad_token", "unk_token")  # special tokens without a sparse weight


def read_m3_heads(path: Path, hidden: int) -> M3Heads | None:
    """The BGE-M3 heads of a model directory (None where it has neither file). Loaded with weights_only=True: a
    pickle that holds anything but tensors is refused by torch, not run."""
    found = [name for name in M3_FILES if (path / name).is_file()]
    if not found:
        return None
    if len(found) == 1:
        raise UnsupportedModel(f"a BGE-M3 directory holds both {' and '.join(M3_FILES)}; {path} has only {found[0]}")
    heads = []
    for name in M3_FILES:
        try:
            state = torch.load(path / name, map_location="cpu", weights_only=True)
            weight, bias = state["weight"].float(), state["bias"].float()
        except Exception as exc:  # a pickle of anything else, or a state dict without a Linear's tensors
            raise UnsupportedModel(f"{name}: not a Linear layer's state dict ({type(exc).__name__}: {exc})") from None
        if weight.ndim != 2 or weight.shape[1] != hidden or bias.shape != weight.shape[:1]:
            raise UnsupportedModel(f"{name}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not make a "
                                   f"Linear layer from the encoder's {hidden} features")
        heads.append((weight, bias))
    (colbert_weight, colbert_bias), (sparse_weight, sparse_bias) = heads
    if sparse_weight.shape[0] != 1:
        raise UnsupportedModel(f"sparse_linear.pt: {sparse_weight.shape[0]} outputs; BGE-M3's sparse head has one")
    return M3Heads(colbert_weight, colbert_bias, sparse_weight, sparse_bias)


@dataclass(frozen=True)
class Pipeline:
    """An embedding model's pipeline after the encoder."""

    pooling: tuple[str, ...] = ("mean",)
    dense: tuple[Dense, ...] = ()
    normalize: bool = True
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    do_lower_case: bool = False
    source: str = "sentence-transformers"
    sparse: Sparse | None = None  # a SPLADE model's head instead of pooling
    m3: M3Heads | None = None  # BGE-M3's multi-vector and sparse heads beside the pooled output
    colbert: Colbert | None = None  # a ColBERT model's projection and text rules instead of pooling (model.colbert)


@dataclass(frozen=True)
class Classifier:
    """A sequence-classification model's head: logits of the first token (or, pooling "mean", of the mean of the
    tokens); or a causal LM's yes/no reranker (head a YesNoReranker: tensors "yes" and "no", the LM head's two rows;
    one logit, yes - no, at the last token)."""

    head: ClassifierHead | YesNoReranker  # the family's layers, by checkpoint name
    tensors: Mapping[str, Tensor]
    labels: tuple[str, ...]  # id2label in label order
    activation: str  # sigmoid | softmax | identity (what predict applies by default)
    pooling: str = "cls"
    norm_eps: float = 1e-12

    @property
    def template(self) -> YesNoReranker | None:
        """A yes/no reranker's prompt template (pairs are written into it before tokenizing), else None."""
        return self.head if isinstance(self.head, YesNoReranker) else None


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"cannot read {path}: {exc}") from exc


def parse_pooling(value: str | list | tuple) -> tuple[str, ...]:
    modes = (value,) if isinstance(value, str) else tuple(value)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad or not modes:
        raise UnsupportedModel(f"pooling mode {', '.join(map(repr, bad or modes))} is not supported; supported: "
                               f"{', '.join(POOLING_MODES)}")
    return modes


def _pooling(config: dict, where: Path) -> tuple[str, ...]:
    if config.get("include_prompt", True) is False:
        raise UnsupportedModel(f"{where}: pooling with include_prompt=false (prompt tokens left out of the pooling) "
                               "is not supported")
    if "pooling_mode" in config:
        return parse_pooling(config["pooling_mode"])
    modes = tuple(mode for key, mode in _LEGACY_POOLING.items() if config.get(key))
    return parse_pooling(modes or ("mean",))


def read_dense(path: Path, default_activation: str = "torch.nn.modules.activation.Tanh") -> Dense:
    """A Dense module's folder (config.json and its linear weights); default_activation: where its config names none
    (sentence-transformers' Dense: Tanh; PyLate's: Identity)."""
    config = _json(path / "config.json")
    activation = _ACTIVATIONS.get(config.get("activation_function", default_activation))
    if activation is None:
        raise UnsupportedModel(f"{path}: Dense activation {config['activation_function']!r} is not supported; "
                               f"supported: {', '.join(_ACTIVATIONS)}")
    if config.get("use_residual"):
        raise UnsupportedModel(f"{path}: Dense with use_residual is not supported")
    weights = path / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        tensors = load_file(weights)
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UnsupportedModel(f"{path}: Dense module without model.safetensors or pytorch_model.bin")
    weight = tensors["linear.weight"].float()
    if tuple(weight.shape) != (config["out_features"], config["in_features"]):
        raise UnsupportedModel(f"{path}: Dense weight {tuple(weight.shape)} does not match its config")
    bias = tensors.get("linear.bias")
    return Dense(weight, bias.float() if bias is not None else None, activation)


def _module_kind(module: dict) -> str:
    """A sentence-transformers module's class name ("Pooling", "SpladePooling"); another library's type as it is."""
    kind = module.get("type", "")
    return kind.rsplit(".", 1)[-1] if kind.startswith("sentence_transformers.") else kind


def _splade(modules: list[dict], path: Path) -> Sparse:
    """SparseEncoder's pipeline: MLMTransformer then SpladePooling (max pooling), nothing after."""
    kinds = [_module_kind(m) for m in modules]
    if kinds[1:] != ["SpladePooling"] or kinds[0] not in ("MLMTransformer", "Transformer"):
        raise UnsupportedModel(f"modules.json: sparse models of modules {', '.join(kinds)} are not supported "
                               "(MLMTransformer then SpladePooling only)")
    config = _json(path / modules[1].get("path", "") / "config.json")
    strategy, activation = config.get("pooling_strategy", "max"), config.get("activation_function", "relu")
    if strategy != "max":
        raise UnsupportedModel(f"SpladePooling pooling_strategy {strategy!r} is not supported (max only)")
    if activation not in _SPLADE_ACTIVATIONS:
        raise UnsupportedModel(f"SpladePooling activation_function {activation!r} is not supported; supported: "
                               f"{', '.join(_SPLADE_ACTIVATIONS)}")
    if config.get("embedding_dimension") not in (None, 0):
        raise UnsupportedModel("SpladePooling with embedding_dimension set (a pruned vocabulary) is not supported")
    return Sparse(activation)


def masked_lm_tensors(sparse: Sparse, rest: dict[str, Tensor], config: EncoderConfig, hf: dict) -> Sparse:
    """The masked-LM head's tensors taken out of a checkpoint's leftovers (weights.load_checkpoint's `rest`) into
    `sparse`, by the family's names; a family without one, or a checkpoint without it, is refused by name."""
    fam = family(config)
    head = fam.masked_lm
    if head is None:
        raise UnsupportedModel(f"sparse (SPLADE) models of the {fam.label} family are not supported (BERT, RoBERTa / "
                               "XLM-RoBERTa and DistilBERT masked-LM heads are)")
    # its transform's activation is the encoder's, which the family's config reading holds to exact GELU
    names = {"transform.weight": f"{head.transform}.weight", "transform.bias": f"{head.transform}.bias",
             "norm.weight": f"{head.norm}.weight", "norm.bias": f"{head.norm}.bias", "decoder.bias": head.bias}
    if head.bias not in rest and f"{head.decoder}.bias" in rest:
        names["decoder.bias"] = f"{head.decoder}.bias"
    missing = [theirs for theirs in names.values() if theirs not in rest]
    if missing:
        raise UnsupportedModel(f"a sparse model needs its masked-LM head; the checkpoint lacks {missing}")
    tensors = {ours: rest.pop(theirs).float() for ours, theirs in names.items()}
    decoder = f"{head.decoder}.weight"
    if hf.get("tie_word_embeddings", True):
        rest.pop(decoder, None)  # tied: the word embeddings (some checkpoints save them again under this name)
    elif decoder in rest:
        tensors["decoder.weight"] = rest.pop(decoder).float()
    else:
        raise UnsupportedModel(f"the masked-LM head's decoder is not tied to the word embeddings and the checkpoint "
                               f"lacks {decoder}")
    rest.pop(f"{head.decoder}.bias", None)  # the same tensor as the head's bias
    return dataclasses.replace(sparse, tensors=tensors, norm_eps=config.layer_norm_eps)


def read_pipeline(path: str | Path, pooling: str | None = None, plain: tuple[str, ...] = ("mean",),
                  colbert: Colbert | None = None) -> Pipeline:
    """The embedding pipeline of a model directory; `pooling` (the POOLING setting) overrides its pooling; `plain`:
    the family's pooling of a plain Hugging Face directory (Family.pooling); `colbert`: a ColBERT model's head
    (model.colbert.read_colbert), which takes the place of pooling and its modules."""
    path = Path(path)
    modules_file = path / "modules.json"
    st = _json(path / "config_sentence_transformers.json") if (path / "config_sentence_transformers.json").is_file() \
        else {}
    bert = _json(path / "sentence_bert_config.json") if (path / "sentence_bert_config.json").is_file() else {}
    prompts = dict(st.get("prompts") or {})
    default_prompt = st.get("default_prompt_name") or None
    if default_prompt is not None and default_prompt not in prompts:
        raise UnsupportedModel(f"default_prompt_name {default_prompt!r} is not among the model's prompts")
    common = dict(prompts=prompts, default_prompt_name=default_prompt,
                  do_lower_case=bool(bert.get("do_lower_case", False)))
    if colbert is not None:
        if pooling:
            raise UnsupportedModel("POOLING does not apply to a ColBERT model: it serves one vector per token")
        return Pipeline((), normalize=False, source="PyLate", colbert=colbert, **common)
    if not modules_file.is_file():
        modes = parse_pooling(pooling) if pooling else plain
        return Pipeline(modes, normalize=True, source="POOLING setting" if pooling else
                        f"plain Hugging Face directory: {'+'.join(plain)} pooling (the family's default; POOLING "
                        "overrides)", **common)
    modes, dense, normalize = None, [], False
    modules = _json(modules_file)
    # SparseEncoder's first module: MLMTransformer, or (sentence-transformers 6) a Transformer of task fill-mask
    task = bert.get("transformer_task", "feature-extraction")
    if task not in ("feature-extraction", "fill-mask"):
        raise UnsupportedModel(f"sentence_bert_config.json: transformer_task {task!r} is not supported")
    if modules and (_module_kind(modules[0]) == "MLMTransformer" or task == "fill-mask"):
        if pooling:
            raise UnsupportedModel("POOLING does not apply to a sparse (SPLADE) model: its pooling is SpladePooling's")
        return Pipeline((), normalize=False, sparse=_splade(modules, path), **common)
    for i, module in enumerate(modules):
        kind, where = _module_kind(module), path / module.get("path", "")
        if i == 0:
            if kind != "Transformer":
                raise UnsupportedModel(f"modules.json: the first module is {module.get('type')!r}, not a Transformer")
            continue
        if kind == "Pooling":
            if modes is not None or dense or normalize:
                raise UnsupportedModel("modules.json: Pooling must come once, right after the Transformer")
            modes = _pooling(_json(where / "config.json"), where)
        elif kind == "Dense":
            if modes is None or normalize:
                raise UnsupportedModel("modules.json: Dense must follow Pooling (and precede Normalize)")
            dense.append(read_dense(where))
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedModel(f"modules.json: module {module.get('type')!r} is not supported; supported: "
                                   "Transformer, Pooling, Dense, Normalize")
    if modes is None:
        raise UnsupportedModel("modules.json has no Pooling module (token embeddings are not served)")
    if pooling:
        modes = parse_pooling(pooling)
    return Pipeline(modes, tuple(dense), normalize, source="POOLING setting" if pooling else "sentence-transformers",
                    **common)


def read_classifier(path: str | Path, config: EncoderConfig, rest: Mapping[str, Tensor],
                    word_embeddings: Tensor | None = None) -> Classifier | None:
    """The classification head of a `*ForSequenceClassification` directory, the yes/no reranker of a `*ForCausalLM`
    one (the family's YesNoReranker; word_embeddings: the LM head where the checkpoint ties it to them), or None for
    an encoder alone."""
    hf = _json(Path(path) / "config.json")
    if any(a.endswith("ForCausalLM") for a in hf.get("architectures") or []):
        return _yes_no_reranker(Path(path), config, hf, rest, word_embeddings)
    if not any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []):
        return None
    head = family(config).classifier
    if head is None:
        raise UnsupportedModel(f"{path}: {family(config).label} sequence classifiers are not supported (its "
                               "embedding models are)")
    layers = (head.first, head.second) + ((head.norm,) if head.norm else ())
    required = [f"{layer}.weight" for layer in layers]
    missing = [n for n in required if n not in rest]
    if missing:
        raise UnsupportedModel(f"{path}: the classification head lacks {missing}")
    wanted = required + [f"{layer}.bias" for layer in layers if f"{layer}.bias" in rest]  # biases where it has them
    extra = sorted(n for n in set(rest) - set(wanted) if not MASKED_LM.match(n))
    if extra:
        raise UnsupportedModel(f"{path}: tensors the classification head does not use, e.g. {extra[:4]}")
    pooling = hf.get(head.pooling_key, "cls") if head.pooling_key else "cls"
    if pooling not in ("cls", "mean"):
        raise UnsupportedModel(f"{path}: {head.pooling_key} {pooling!r} is not supported (cls or mean)")
    if head.activation == "gelu" and hf.get("classifier_activation", "gelu") != "gelu":
        raise UnsupportedModel(f"{path}: classifier_activation {hf['classifier_activation']!r} is not supported "
                               "(only exact GELU, 'gelu')")
    num_labels = rest[f"{head.second}.weight"].shape[0]
    id2label = hf.get("id2label") or {str(i): f"LABEL_{i}" for i in range(num_labels)}
    labels = tuple(id2label.get(str(i), id2label.get(i, f"LABEL_{i}")) for i in range(num_labels))
    declared = (hf.get("sentence_transformers") or {}).get("activation_fn") \
        or hf.get("sbert_ce_default_activation_function")
    if declared is not None:
        activation = SCORE_ACTIVATIONS.get(declared)
        if activation is None:
            raise UnsupportedModel(f"{path}: score activation {declared!r} is not supported; supported: "
                                   f"{', '.join(SCORE_ACTIVATIONS)}")
    elif hf.get("problem_type") == "multi_label_classification":  # independent labels, as transformers scores them
        activation = "sigmoid"
    else:
        activation = "sigmoid" if num_labels == 1 else "softmax"
    return Classifier(head, {n: rest[n].float() for n in wanted}, labels, activation, pooling,
                      hf.get("norm_eps", hf.get("layer_norm_eps", 1e-12)))


def _yes_no_reranker(path: Path, config: EncoderConfig, hf: dict, rest: Mapping[str, Tensor],
                     word_embeddings: Tensor | None) -> Classifier:
    reranker = family(config).reranker
    if reranker is None:
        raise UnsupportedModel(f"{path}: a {family(config).label} causal LM ({', '.join(hf['architectures'])}) is not "
                               "served: a causal LM is served only as a yes/no reranker (Qwen3-Reranker's use)")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = {word: vocab.token_to_id(word) for word in (reranker.yes, reranker.no)}
    if None in ids.values():
        raise UnsupportedModel(f"{path}: the tokenizer has no single token {reranker.yes!r} / {reranker.no!r} (a "
                               "yes/no reranker scores those two next tokens)")
    lm_head = rest.get("lm_head.weight")
    if lm_head is None:
        if not hf.get("tie_word_embeddings", False) or word_embeddings is None:
            raise UnsupportedModel(f"{path}: no lm_head.weight and tie_word_embeddings is not set: the LM head is "
                                   "missing")
        lm_head = word_embeddings
    extra = sorted(n for n in rest if n != "lm_head.weight")
    if extra:
        raise UnsupportedModel(f"{path}: tensors the reranker does not use, e.g. {extra[:4]}")
    tensors = {word: lm_head[i].detach().float().clone() for word, i in ids.items()}
    return Classifier(reranker, tensors, ("score",), "sigmoid", "lasttoken")


def classification_head(classifier: Classifier) -> nn.Module:
    """The head module a classifier runs."""
    return YesNoHead(classifier) if isinstance(classifier.head, YesNoReranker) else ClassificationHead(classifier)


def _first_tokens(hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
    # each sequence's first row; a graph bucket's filler sequences start at the end: clamped to a real row
    return hidden.index_select(0, cu_seqlens[:-1].long().clamp(max=hidden.shape[0] - 1))


def _last_tokens(hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
    # each sequence's last row (a decoder's summary of all its tokens: lasttoken pooling); a filler sequence (length
    # 0, at the end) reads the last real row
    return hidden.index_select(0, (cu_seqlens[1:].long() - 1).clamp(min=0))


def _last_padded(hidden: Tensor, mask: Tensor) -> Tensor:
    # each row's last real token in a batch padded on the right (the padded layout, a test oracle)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.sum(1).long() - 1]


def linear_of(dense: Dense) -> nn.Linear:
    """A Dense module's projection as an nn.Linear holding its tensors (its activation is the caller's)."""
    layer = nn.Linear(dense.weight.shape[1], dense.weight.shape[0], bias=dense.bias is not None)
    with torch.no_grad():
        layer.weight.copy_(dense.weight)
        if dense.bias is not None:
            layer.bias.copy_(dense.bias)
    return layer


class EmbeddingHead(nn.Module):
    """Pooling (one or several modes, concatenated in sentence-transformers' order) then the Dense modules."""

    ops: tuple[str, ...] = ()  # the kernels ops a head calls beyond its family's (the registry selects them too)

    def __init__(self, pipeline: Pipeline, hidden: int) -> None:
        super().__init__()
        self.modes = pipeline.pooling
        self.dense = nn.ModuleList()
        self.activations = []
        width = hidden * len(self.modes)
        for d in pipeline.dense:
            if d.weight.shape[1] != width:
                raise UnsupportedModel(f"Dense takes {d.weight.shape[1]} features, the pooling gives {width}")
            self.dense.append(linear_of(d))
            self.activations.append(d.activation)
            width = d.weight.shape[0]
        self.dim = width

    def forward(self, hidden: Tensor, p) -> Tensor:
        # hidden [T, H] packed (model.packing.Packed p) -> [batch, dim] float32
        pooled = []
        for mode in self.modes:
            if mode == "cls":
                pooled.append(_first_tokens(hidden, p.cu_seqlens).float())
            elif mode == "lasttoken":
                pooled.append(_last_tokens(hidden, p.cu_seqlens).float())
            elif mode == "max":
                rows = torch.full((p.batch + 1, hidden.shape[1]), float("-inf"), device=hidden.device)
                rows.scatter_reduce_(0, p.seq_index[:, None].expand(-1, hidden.shape[1]), hidden.float(), "amax")
                pooled.append(rows[: p.batch])
            else:  # mean, mean_sqrt_len_tokens: one segment_mean kernel on a fused backend
                mean = kernels.segment_mean(hidden, p.cu_seqlens).float()
                pooled.append(mean if mode == "mean" else mean * p.lengths[:, None].float().sqrt())
        return self._project(torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0])

    def forward_padded(self, hidden: Tensor, mask: Tensor) -> Tensor:
        # hidden [batch, seq, H], mask [batch, seq] bool -> [batch, dim] float32 (the padded layout, a test oracle)
        hidden, m = hidden.float(), mask[..., None].float()
        pooled = []
        for mode in self.modes:
            if mode == "cls":
                pooled.append(hidden[:, 0])
            elif mode == "lasttoken":
                pooled.append(_last_padded(hidden, mask))
            elif mode == "max":
                pooled.append(hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values)
            else:
                total, count = (hidden * m).sum(1), m.sum(1).clamp(min=1e-9)
                pooled.append(total / (count if mode == "mean" else count.sqrt()))
        return self._project(torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0])

    def _project(self, x: Tensor) -> Tensor:
        for layer, activation in zip(self.dense, self.activations):
            x = F.linear(x, layer.weight.float(), None if layer.bias is None else layer.bias.float())
            x = torch.tanh(x) if activation == "tanh" else x
        return x


class SparseHead(nn.Module):
    """A SPLADE model's vectors [batch, vocabulary] float32: the masked-LM head's transform (GELU(x W^T + b), then
    LayerNorm) on every token, then kernels.splade_pool: the decoder GEMM onto the vocabulary with log(1 + relu) and
    the max over each input's tokens in its epilogue. Unlike the other heads it runs in the encoder's dtype: its
    GEMMs are the size of a layer's (the decoder's is several), too large for float32."""

    ops = ("linear_bias_gelu", "layer_norm", "splade_pool")

    def __init__(self, sparse: Sparse, word_embeddings: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        t = sparse.tensors
        self.activation, self.eps = sparse.activation, sparse.norm_eps

        def param(x: Tensor) -> nn.Parameter:
            return nn.Parameter(x.to(dtype), requires_grad=False)

        self.transform_weight, self.transform_bias = param(t["transform.weight"]), param(t["transform.bias"])
        self.norm_weight, self.norm_bias = param(t["norm.weight"]), param(t["norm.bias"])
        # tied: the encoder's own tensor, not a copy
        self.decoder_weight = param(t["decoder.weight"]) if "decoder.weight" in t else word_embeddings
        self.decoder_bias = param(t["decoder.bias"])
        self.dim = self.decoder_weight.shape[0]

    def forward(self, hidden: Tensor, p) -> Tensor:
        x = kernels.linear_bias_gelu(hidden, self.transform_weight, self.transform_bias)
        x = kernels.layer_norm(x, self.norm_weight, self.norm_bias, self.eps)
        return self._activate(kernels.splade_pool(x, self.decoder_weight, self.decoder_bias, p.cu_seqlens))

    def forward_padded(self, hidden: Tensor, mask: Tensor) -> Tensor:
        # the padded layout in plain torch, the logits materialized (a test oracle)
        x = F.gelu(F.linear(hidden.float(), self.transform_weight.float(), self.transform_bias.float()))
        x = F.layer_norm(x, x.shape[-1:], self.norm_weight.float(), self.norm_bias.float(), self.eps)
        logits = F.linear(x, self.decoder_weight.float(), self.decoder_bias.float())
        return self._activate((torch.log1p(torch.relu(logits)) * mask[..., None].float()).amax(dim=1))

    def _activate(self, pooled: Tensor) -> Tensor:
        return pooled.log1p() if self.activation == "log1p_relu" else pooled


class M3Head(nn.Module):
    """BGE-M3's multi-vector and sparse outputs from the encoder's packed per-token states (on the device, in its
    dtype; each input's rows back to back, special tokens included), as FlagEmbedding's M3Embedder computes them:
    - colbert: colbert_linear over every token after each input's first, each row L2-normalized in float32:
      [tokens - n, dim];
    - sparse: kernels.m3_sparse: per token ReLU(sparse_linear), kept where the token holds its input's largest weight
      for its id (the first of equals) and the id is not one of the `dropped` specials (CLS, EOS, PAD, UNK), zero
      elsewhere: [tokens] float32. Each input's kept (id, weight) pairs are FlagEmbedding's lexical weights, without
      the [n, vocabulary] block its scatter_reduce fills (250,002 wide for BGE-M3)."""

    ops = ("m3_sparse",)

    def __init__(self, heads: M3Heads, dropped: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()

        def param(x: Tensor, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(x.to(dtype), requires_grad=False)

        self.colbert_weight, self.colbert_bias = param(heads.colbert_weight, dtype), param(heads.colbert_bias, dtype)
        self.sparse_weight = param(heads.sparse_weight[0], dtype)
        self.sparse_bias = param(heads.sparse_bias, torch.float32)
        self.register_buffer("dropped", torch.tensor(sorted(set(dropped)), dtype=torch.int32), persistent=False)
        self.colbert_dim = heads.colbert_weight.shape[0]

    def block(self, output: str, hidden: Tensor, packed, dense: nn.Module) -> Tensor:
        """launch's block of `output` from one forward's per-token states: "colbert" [tokens - n, dim], "sparse"
        [tokens, 1], or "m3", all three flattened into one column ([n * dense width + (tokens - n) * dim + tokens,
        1]: the `dense` head's raw rows, the multi-vectors, the sparse weights; model.api.split_m3 takes it apart)."""
        cu_seqlens = packed.cu_seqlens
        if output == "colbert":
            return self.colbert(hidden, cu_seqlens)
        sparse = self.sparse(hidden, packed.input_ids[: hidden.shape[0]], cu_seqlens)[:, None]
        if output == "sparse":
            return sparse
        pooled = dense(hidden, packed).float()
        return torch.cat([pooled.reshape(-1), self.colbert(hidden, cu_seqlens).reshape(-1), sparse.reshape(-1)])[:, None]

    def colbert(self, hidden: Tensor, cu_seqlens: Tensor) -> Tensor:
        keep = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        keep[cu_seqlens[:-1].long()] = False  # each input's first token (CLS) has no vector
        return F.normalize(F.linear(hidden[keep], self.colbert_weight, self.colbert_bias).float(), dim=-1)

    def sparse(self, hidden: Tensor, ids: Tensor, cu_seqlens: Tensor) -> Tensor:
        return kernels.m3_sparse(hidden, self.sparse_weight, self.sparse_bias, ids.int(), cu_seqlens, self.dropped)


class ClassificationHead(nn.Module):
    """The architecture's classifier on each sequence's first token (or its tokens' mean): logits [batch,
    num_labels] float32."""

    ops: tuple[str, ...] = ()

    def __init__(self, classifier: Classifier) -> None:
        super().__init__()
        t, head = classifier.tensors, classifier.head
        self.activation, self.pooling, self.eps = head.activation, classifier.pooling, classifier.norm_eps

        def tensor(name: str) -> nn.Parameter | None:
            return nn.Parameter(t[name].clone(), requires_grad=False) if name in t else None

        self.inner_weight, self.inner_bias = tensor(f"{head.first}.weight"), tensor(f"{head.first}.bias")
        self.norm_weight = tensor(f"{head.norm}.weight") if head.norm else None
        self.norm_bias = tensor(f"{head.norm}.bias") if head.norm else None
        self.out_weight, self.out_bias = tensor(f"{head.second}.weight"), tensor(f"{head.second}.bias")
        self.dim = self.out_weight.shape[0]

    def forward(self, hidden: Tensor, p) -> Tensor:
        if self.pooling == "mean":
            return self._classify(kernels.segment_mean(hidden, p.cu_seqlens).float())
        return self._classify(_first_tokens(hidden, p.cu_seqlens))

    def forward_padded(self, hidden: Tensor, mask: Tensor) -> Tensor:
        if self.pooling == "mean":
            m = mask[..., None].float()
            return self._classify((hidden.float() * m).sum(1) / m.sum(1).clamp(min=1e-9))
        return self._classify(hidden[:, 0])

    def _classify(self, pooled: Tensor) -> Tensor:
        x = F.linear(pooled.float(), self.inner_weight.float(), _float(self.inner_bias))
        x = {"relu": torch.relu, "gelu": F.gelu}.get(self.activation, torch.tanh)(x)
        if self.norm_weight is not None:
            x = F.layer_norm(x, x.shape[-1:], self.norm_weight.float(), _float(self.norm_bias), self.eps)
        return F.linear(x, self.out_weight.float(), _float(self.out_bias))


class YesNoHead(nn.Module):
    """A yes/no reranker's score logit at each sequence's last token: (W_yes - W_no) . h, the log-odds of "yes"
    against "no" as the next token ([batch, 1] float32; sigmoid makes it their softmax probability)."""

    ops: tuple[str, ...] = ()

    def __init__(self, classifier: Classifier) -> None:
        super().__init__()
        rows = torch.stack([classifier.tensors[classifier.head.yes], classifier.tensors[classifier.head.no]])
        self.rows = nn.Parameter(rows, requires_grad=False)
        self.dim = 1

    def forward(self, hidden: Tensor, p) -> Tensor:
        return self._score(_last_tokens(hidden, p.cu_seqlens))

    def forward_padded(self, hidden: Tensor, mask: Tensor) -> Tensor:
        return self._score(_last_padded(hidden, mask))

    def _score(self, last: Tensor) -> Tensor:
        yes, no = F.linear(last.float(), self.rows.float()).unbind(1)
        return (yes - no)[:, None]


def _float(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float()


def activate(logits: Tensor, activation: str) -> Tensor:
    """Scores from logits [n, labels] float32, as the model's activation says."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits

"""The DeBERTa-v2 family (transformers' DebertaV2Model: DeBERTa-v3, mDeBERTa-v3, DeBERTa-v2, and their NLI and
reranker fine-tunes as DebertaV2ForSequenceClassification): BERT's post-LN layers with disentangled attention, where
each head's score of query i for key j adds two terms of their relative position to the content term:

    score(i, j) = (q_i . k_j  +  q_i . Pk[r(i, j)]  +  k_j . Pq[r(i, j)]) / sqrt(head_dim * (1 + len(pos_att_type)))
                   content       c2p: content to position  p2c: position to content

P is the relative table `rel_embeddings` (2 x span rows shared by every layer, LayerNorm-ed where norm_rel_ebd says
"layer_norm") projected by each layer's own key and query projections (share_att_key; else by its pos_key_proj and
pos_query_proj), and r(i, j) the table row of the distance i - j: exact up to position_buckets / 2, log-bucketed
beyond (up to max_relative_positions), offset by span and clamped to the table. Where position_biased_input is false
(v3) that is the only way positions enter; where it is true a learned absolute table is added to the embeddings as
BERT's. pos_att_type counts in the scale even where relative_attention is off, as in transformers.

The two position terms depend on the content, not on the distance alone as MPNet's bias does. The row of every
distance is computed once, with transformers' own bucketing, and each layer projects the relative table for the terms
it has. On the fused path a packed batch's attention is one op, kernels.disentangled_attention: it computes both
terms per tile of scores from the projected tables and the row per distance, so no [heads, seq, seq] term is ever
built (CUDA graphs capture it: no host sync). The reference path (the fused path off, the verifier's copy, the padded
layout that is the tests' oracle) is plain torch: both terms gathered per head into an additive mask for SDPA, as
transformers does. The residual blocks and embeddings are the post-norm ones BERT has (model/layers.py) on the fused
ops. The DeBERTa-v2-xlarge ConvLayer (conv_kernel_size), a projected embedding (embedding_size) and activations other
than exact GELU are refused by name."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.kernels.registry import REFERENCE_BACKEND
from fusedserve.model import layers, packing
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import ClassifierHead, Family, WeightLayout
from fusedserve.model.packing import Packed

_TERMS = ("c2p", "p2c")


@dataclass(frozen=True)
class Disentangled:
    """config.json's disentangled attention (EncoderConfig.section), with transformers' DebertaV2 defaults."""

    relative_attention: bool = False
    terms: tuple[str, ...] = ()  # pos_att_type's c2p / p2c: the position terms, and the scale's count
    span: int = 512  # the relative table's rows on each side: position_buckets, else max_relative_positions
    buckets: int = -1  # position_buckets; <= 0: exact distances
    max_relative_positions: int = 512
    share_att_key: bool = False
    norm_rel_ebd: bool = False  # norm_rel_ebd "layer_norm": the table is LayerNorm-ed before use
    position_biased_input: bool = True  # a learned absolute position table in the embeddings


def _listed(value, key: str) -> list[str]:
    # transformers reads "c2p|p2c" and ["c2p", "p2c"] alike
    if value is None:
        return []
    if isinstance(value, str):
        return [x.strip() for x in value.lower().split("|") if x.strip()]
    if isinstance(value, (list, tuple)):
        return [str(x).strip().lower() for x in value]
    raise UnsupportedModel(f"{key} {value!r} is not supported (a list or '|'-joined string)")


def _read(hf: dict) -> dict:
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only exact GELU, 'gelu')")
    if any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or []):
        pooler = hf.get("pooler_hidden_act", "gelu")
        if pooler != "gelu":  # the classification head's ContextPooler activation
            raise UnsupportedModel(f"pooler_hidden_act {pooler!r} is not supported (only exact GELU, 'gelu')")
    if (hf.get("conv_kernel_size") or 0) > 0:
        raise UnsupportedModel(f"conv_kernel_size {hf['conv_kernel_size']} is not supported (DeBERTa-v2's ConvLayer "
                               "after the first layer; DeBERTa-v3 has none)")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("embedding_size", hidden) != hidden:
        raise UnsupportedModel(f"embedding_size {hf['embedding_size']} other than hidden_size {hidden} (a projected "
                               "embedding) is not supported")
    if hf.get("attention_head_size", hidden // heads) != hidden // heads:
        raise UnsupportedModel(f"attention_head_size {hf['attention_head_size']} other than hidden_size / "
                               "num_attention_heads is not supported")
    terms = _listed(hf.get("pos_att_type"), "pos_att_type")
    if set(terms) - set(_TERMS):
        raise UnsupportedModel(f"pos_att_type {sorted(set(terms) - set(_TERMS))} is not supported (c2p and p2c "
                               "only)")
    norms = _listed(hf.get("norm_rel_ebd", "none"), "norm_rel_ebd")
    if set(norms) - {"none", "layer_norm"}:
        raise UnsupportedModel(f"norm_rel_ebd {hf['norm_rel_ebd']!r} is not supported (none or layer_norm)")
    positions = hf.get("max_position_embeddings", 512)
    reach = hf.get("max_relative_positions", -1)
    reach = reach if reach >= 1 else positions
    buckets = hf.get("position_buckets", -1)
    section = Disentangled(
        relative_attention=bool(hf.get("relative_attention", False)), terms=tuple(t for t in _TERMS if t in terms),
        span=buckets if buckets > 0 else reach, buckets=buckets, max_relative_positions=reach,
        share_att_key=bool(hf.get("share_att_key", False)), norm_rel_ebd="layer_norm" in norms,
        position_biased_input=bool(hf.get("position_biased_input", True)))
    return dict(vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["num_hidden_layers"], num_heads=heads,
                intermediate_size=hf["intermediate_size"],
                # DeBERTa-v3 has no token types (0): one all-zero row (model.weights)
                type_vocab_size=max(hf.get("type_vocab_size", 0), 1), layer_norm_eps=hf.get("layer_norm_eps", 1e-7),
                pad_token_id=hf.get("pad_token_id") or 0, max_position_embeddings=positions,
                max_seq_length=positions, section=section)


def _from_hub_layout(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A *ForSequenceClassification checkpoint names its encoder under `deberta.`."""
    return {k.removeprefix("deberta."): t for k, t in tensors.items()}


_WEIGHTS = WeightLayout(
    {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings",  # position_biased_input only
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings",  # none: a zero row
        "embeddings.LayerNorm.weight": "embeddings.ln_weight",
        "embeddings.LayerNorm.bias": "embeddings.ln_bias",
        "encoder.rel_embeddings.weight": "rel_embeddings",
        "encoder.LayerNorm.weight": "rel_ln_weight",
        "encoder.LayerNorm.bias": "rel_ln_bias",
    },
    "encoder.layer.",
    {
        "attention.self.pos_key_proj.weight": "pos_key_proj.weight",
        "attention.self.pos_key_proj.bias": "pos_key_proj.bias",
        "attention.self.pos_query_proj.weight": "pos_query_proj.weight",
        "attention.self.pos_query_proj.bias": "pos_query_proj.bias",
        "attention.output.dense.weight": "attn_out.weight",
        "attention.output.dense.bias": "attn_out.bias",
        "attention.output.LayerNorm.weight": "attn_ln_weight",
        "attention.output.LayerNorm.bias": "attn_ln_bias",
        "intermediate.dense.weight": "ffn_in.weight",
        "intermediate.dense.bias": "ffn_in.bias",
        "output.dense.weight": "ffn_out.weight",
        "output.dense.bias": "ffn_out.bias",
        "output.LayerNorm.weight": "ffn_ln_weight",
        "output.LayerNorm.bias": "ffn_ln_bias",
    },
    ("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj"),
    rename=_from_hub_layout,
    # what the config switches on or off (the encoder built from it says which it needs)
    optional=frozenset({"embeddings.position_embeddings.weight", "encoder.rel_embeddings.weight",
                        "encoder.LayerNorm.weight", "encoder.LayerNorm.bias",
                        "attention.self.pos_key_proj.weight", "attention.self.pos_key_proj.bias",
                        "attention.self.pos_query_proj.weight", "attention.self.pos_query_proj.bias"}),
)


def relative_rows(reach: int, s: Disentangled) -> Tensor:
    """The relative table's row for each query - key distance -(reach - 1) .. reach - 1, in that order: transformers'
    make_log_bucket_position (same float32 ops, so the same bucket at every boundary), then the offset by span and
    the clamp to the table that its c2p and p2c gathers apply."""
    r = torch.arange(1 - reach, reach)
    if s.buckets > 0 and s.max_relative_positions > 0:
        sign, mid = torch.sign(r), s.buckets // 2
        near = torch.where((r < mid) & (r > -mid), torch.tensor(mid - 1).type_as(r), torch.abs(r))
        far = torch.ceil(torch.log(near / mid) / torch.log(torch.tensor((s.max_relative_positions - 1) / mid))
                         * (mid - 1)) + mid
        r = torch.where(near <= mid, r.type_as(far), far * sign).long()
    return torch.clamp(r + s.span, 0, 2 * s.span - 1)


def pair_rows(rows: Tensor, seq: int) -> Tensor:
    """[seq, seq]: the table row of query i and key j (distance i - j) from relative_rows' `rows`."""
    reach = (rows.shape[0] + 1) // 2
    i = torch.arange(seq, device=rows.device)
    return rows[i[:, None] - i[None, :] + reach - 1]


def disentangled_attention(q: Tensor, k: Tensor, v: Tensor, pos_k: Tensor | None, pos_q: Tensor | None,
                           index: Tensor, scale: float, key_mask: Tensor | None) -> Tensor:
    """q, k, v [batch, heads, seq, head_dim]; pos_k, pos_q [2 span, hidden] (the projected table for c2p and p2c,
    heads along columns; None: that term is off); index [seq, seq] (pair_rows); key_mask [batch, 1, 1, seq] bool
    (True = attend) or None -> context [batch, heads, seq, head_dim]."""
    b, h, s, d = q.shape

    def per_head(table: Tensor) -> Tensor:  # [2 span, hidden] -> [heads, 2 span, head_dim]
        return table.view(table.shape[0], h, d).transpose(0, 1)

    bias = None
    if pos_k is not None:  # c2p(i, j) = q_i . Pk[r(i, j)]
        bias = torch.matmul(q, per_head(pos_k).transpose(-1, -2)).gather(-1, index.expand(b, h, s, s))
    if pos_q is not None:  # p2c(i, j) = k_j . Pq[r(i, j)]: gathered per key row, then turned to (query, key)
        p2c = torch.matmul(k, per_head(pos_q).transpose(-1, -2)).gather(-1, index.t().expand(b, h, s, s))
        bias = p2c.transpose(-1, -2) if bias is None else bias + p2c.transpose(-1, -2)
    if bias is not None:
        bias = bias / scale
        if key_mask is not None:
            bias = bias.masked_fill(~key_mask, float("-inf"))
    mask = bias if bias is not None else key_mask
    with packing.pinned_sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / scale)


class Layer(layers.PostNormLayer):
    """The post-norm layer with disentangled attention: q, k, v stacked as BERT's, the relative table projected by
    this layer's key and query projections (or its pos_key_proj / pos_query_proj)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config)
        s: Disentangled = config.section
        h = config.hidden_size
        self.terms = s.terms if s.relative_attention else ()
        self.shared = s.share_att_key
        if s.relative_attention and not s.share_att_key:
            if "c2p" in s.terms:
                self.pos_key_proj = nn.Linear(h, h)
            if "p2c" in s.terms:
                self.pos_query_proj = nn.Linear(h, h)
        self.scale = math.sqrt(config.head_dim * (1 + len(s.terms)))
        # no position term and BERT's 1 / sqrt(d) (pos_att_type empty): the attention every family shares
        self.plain = not self.terms and not s.terms

    def positions(self, table: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """The relative table [2 span, hidden] projected for c2p (keys) and p2c (queries), each [2 span, hidden] with
        the heads along its columns as qkv's, None where the term is off. Shared keys and both terms: one GEMM by the
        stacked query and key rows of the QKV weight, each table a column slice of its output."""
        h = self.attn_out.weight.shape[0]
        w, b = self.qkv.weight, self.qkv.bias
        if not self.terms:
            return None, None
        if self.shared and len(self.terms) == 2:
            both = F.linear(table, w[:2 * h], b[:2 * h])
            return both[:, h:], both[:, :h]
        pos_k = pos_q = None
        if "c2p" in self.terms:
            pos_k = F.linear(table, w[h:2 * h], b[h:2 * h]) if self.shared else self.pos_key_proj(table)
        if "p2c" in self.terms:
            pos_q = F.linear(table, w[:h], b[:h]) if self.shared else self.pos_query_proj(table)
        return pos_k, pos_q

    def _padded(self, qkv: Tensor, batch: int, seq: int, pos: tuple, rows: Tensor, mask: Tensor | None) -> Tensor:
        # qkv [batch * seq, 3 hidden] -> context [batch * seq, hidden]
        q, k, v = qkv.view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        ctx = disentangled_attention(q, k, v, *pos, pair_rows(rows, seq), self.scale, mask)
        return ctx.transpose(1, 2).reshape(batch * seq, -1)

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor, context) -> Tensor:
        # the padded layout (a test oracle): x [batch * seq, hidden], attn_mask [batch, 1, 1, seq] bool
        table, rows, _ = context
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        return self.residual_blocks(x, self._padded(qkv, batch, seq, self.positions(table), rows, attn_mask))

    def forward_packed(self, x: Tensor, p: Packed, context) -> Tensor:
        return self.residual_blocks(x, self.attend(F.linear(x, self.qkv.weight, self.qkv.bias), p, context))

    def attend(self, qkv: Tensor, p: Packed, context) -> Tensor:
        """A packed batch's attention, qkv [T, 3 hidden] -> [T, hidden]. No position term at BERT's scale: the
        attention every family shares (model.packing). On the fused path, kernels.disentangled_attention over
        cu_seqlens. On the reference path plain torch: a dense batch as its padded block; on the CPU with varlen
        attention one sequence at a time (no padded block, as model.packing.sequence_attention); else scattered into a
        padded block and gathered back (CUDA graphs capture that: no host sync)."""
        table, rows, attention = context
        if self.plain:
            return packing.packed_attention(qkv, p, self.num_heads, attention)
        pos = self.positions(table)
        if p.cu_seqlens is not None and kernels.current().backend_of("disentangled_attention") != REFERENCE_BACKEND:
            return kernels.disentangled_attention(qkv, p.cu_seqlens, p.seq, self.num_heads, *pos, rows,
                                                  1.0 / self.scale)
        if p.dense:
            return self._padded(qkv, p.batch, p.seq, pos, rows, None)
        if attention == "varlen" and qkv.device.type == "cpu":
            out = qkv.new_zeros((qkv.shape[0], qkv.shape[1] // 3))
            bounds = p.cu_seqlens.tolist()
            for start, end in zip(bounds, bounds[1:]):
                if end > start:
                    out[start:end] = self._padded(qkv[start:end], 1, end - start, pos, rows, None)
            return out
        padded = qkv.new_zeros((p.batch * p.seq + 1, qkv.shape[1])).index_copy_(0, p.pad_index, qkv)
        ctx = self._padded(padded[:-1], p.batch, p.seq, pos, rows, p.attn_mask)
        return ctx.index_select(0, p.gather_index)


class Encoder(layers.Encoder):
    def __init__(self, config: EncoderConfig) -> None:
        s: Disentangled = config.section
        embeddings = layers.Embeddings(config) if s.position_biased_input else layers.TokenTypeEmbeddings(config)
        super().__init__(config, embeddings, (Layer(config) for _ in range(config.num_layers)))
        self.relative = s.relative_attention
        if s.relative_attention:
            self.rel_embeddings = nn.Parameter(torch.empty(2 * s.span, config.hidden_size))
            if s.norm_rel_ebd:
                layers.layer_norm_parameters(self, "rel_ln", config.hidden_size)
        self.register_buffer("distance_rows", relative_rows(config.max_position_embeddings, s), persistent=False)
        self.reset_parameters()

    def relative_table(self) -> Tensor | None:
        """[2 span, hidden]: the relative embeddings as every layer reads them (LayerNorm-ed by norm_rel_ebd)."""
        if not self.relative:
            return None
        if not hasattr(self, "rel_ln_weight"):
            return self.rel_embeddings
        return F.layer_norm(self.rel_embeddings, self.rel_embeddings.shape[-1:], self.rel_ln_weight, self.rel_ln_bias,
                            self.config.layer_norm_eps)

    def layer_context(self, attention: str):
        return self.relative_table(), self.distance_rows, attention

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        # input_ids, attention_mask, token_type_ids: [batch, seq] -> hidden states [batch, seq, hidden]
        batch, seq = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        x = self.embeddings(input_ids.reshape(-1), position_ids.reshape(-1), token_type_ids.reshape(-1))
        context = self.layer_context("pad")
        attn_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, batch, seq, attn_mask, context)
        return x.view(batch, seq, -1)


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    ops = ["embedding_layer_norm", "linear_add_layer_norm", "linear_bias_gelu"]
    if layout == "packed":
        ops += ["disentangled_attention", "segment_mean"]
    return tuple(ops)


# sequence classifiers: ContextPooler (dense + pooler_hidden_act on the first token), then the classifier
DEBERTA_V2 = Family("deberta_v2", ("deberta-v2",), "DeBERTa-v2 / v3", _read, _WEIGHTS,
                    ClassifierHead("pooler.dense", "gelu", "classifier"), encoder=Encoder, kernel_ops=kernel_ops,
                    positions="disentangled relative (c2p, p2c)", few_token_layer=False)
FAMILIES = (DEBERTA_V2,)

"""The MPNet family (all-mpnet-base-v2 and its fine-tunes): BERT's post-LN layers with one change in attention, a
relative position bias shared by all layers and added to every head's scores. Positions are counted from the padding
index + 1 as RoBERTa's (transformers' MPNetEmbeddings fixes that index at 1), there are no token types, and the
weights have their own names (`attention.attn.q`, ...; the bias table is `encoder.relative_attention_bias`).

The bias depends only on the head and the distance j - i between key and query: transformers buckets the distance
(32 buckets, log-spaced past 8, saturating at 128) and looks each bucket up in an [buckets, heads] embedding. Here
the bucket of every distance a sequence can have is computed once, with transformers' own formula, and each forward
gathers the [heads, 2R - 1] table of biases by distance from the current weights: the fused attention
(kernels.relative_attention) reads it per tile, so no [heads, T, T] bias is ever built on the packed path. The rest of
the layer, its FP8 step and the embeddings are the post-norm blocks it shares with BERT (model/layers.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedserve import kernels
from fusedserve.model import layers
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import ClassifierHead, Family, WeightLayout
from fusedserve.model.packing import Packed

# transformers' MPNetEncoder.compute_position_bias buckets with these whatever the config's bucket count says (the
# count only sizes the embedding)
BUCKETS, MAX_DISTANCE = 32, 128
_PADDING_INDEX = 1  # MPNetEmbeddings.padding_idx: positions start at 2


def _read_mpnet(hf: dict) -> dict:
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only exact GELU, 'gelu')")
    buckets = hf.get("relative_attention_num_buckets", BUCKETS)
    if buckets < BUCKETS:  # transformers would index past the table
        raise UnsupportedModel(f"relative_attention_num_buckets {buckets} is not supported (MPNet buckets relative "
                               f"positions into {BUCKETS})")
    shift = _PADDING_INDEX + 1
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"], type_vocab_size=1,
                layer_norm_eps=hf.get("layer_norm_eps", 1e-12), pad_token_id=hf.get("pad_token_id", 1),
                max_position_embeddings=hf["max_position_embeddings"], position_offset=shift,
                max_seq_length=hf["max_position_embeddings"] - shift, relative_attention_buckets=buckets)


_MPNET_WEIGHTS = WeightLayout(
    {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings",
        "embeddings.LayerNorm.weight": "embeddings.ln_weight",
        "embeddings.LayerNorm.bias": "embeddings.ln_bias",
        "encoder.relative_attention_bias.weight": "relative_attention_bias",
    },
    "encoder.layer.",
    {
        "intermediate.dense.weight": "ffn_in.weight",
        "intermediate.dense.bias": "ffn_in.bias",
        "output.dense.weight": "ffn_out.weight",
        "output.dense.bias": "ffn_out.bias",
        "output.LayerNorm.weight": "ffn_ln_weight",
        "output.LayerNorm.bias": "ffn_ln_bias",
        "attention.attn.o.weight": "attn_out.weight",
        "attention.attn.o.bias": "attn_out.bias",
        "attention.LayerNorm.weight": "attn_ln_weight",
        "attention.LayerNorm.bias": "attn_ln_bias",
    },
    ("attention.attn.q", "attention.attn.k", "attention.attn.v"),
)


def relative_buckets(distance: Tensor) -> Tensor:
    """transformers' MPNetEncoder.relative_position_bucket of key - query distances (bidirectional: one half of the
    buckets for each sign, exact up to 8 apart, log-spaced up to 128)."""
    n = -distance
    half = BUCKETS // 2
    bucket = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(MAX_DISTANCE / exact) * (half - exact)).long()
    return bucket + torch.where(n < exact, n, large.clamp(max=half - 1))


class Layer(layers.PostNormLayer):
    """The post-norm layer; its attention adds the relative position bias table (kernels.relative_attention)."""

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor, bias: Tensor) -> Tensor:
        # the padded layout (a test oracle): bias [heads, seq, seq] plus the key mask as SDPA's float mask
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        mask = bias.to(q.dtype)[None].masked_fill(~attn_mask, float("-inf"))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch * seq, -1)
        return self.residual_blocks(x, ctx)

    def forward_packed(self, x: Tensor, p: Packed, table: Tensor) -> Tensor:
        return self.residual_blocks(x, self.attend(F.linear(x, self.qkv.weight, self.qkv.bias), p, table))

    def attend(self, qkv: Tensor, p: Packed, table: Tensor) -> Tensor:
        return kernels.relative_attention(qkv, p.cu_seqlens, p.seq, self.num_heads, table)


class Encoder(layers.PostNormEncoder):
    def __init__(self, config: EncoderConfig) -> None:
        # one all-zero token type (model.weights)
        super().__init__(config, layers.Embeddings(config), (Layer(config) for _ in range(config.num_layers)))
        self.relative_attention_bias = nn.Parameter(torch.empty(config.relative_attention_buckets,
                                                                config.num_heads))
        # the bucket of each distance -(R - 1) .. R - 1 a sequence of the model can have, R its positions
        reach = config.max_position_embeddings
        self.register_buffer("distance_buckets", relative_buckets(torch.arange(1 - reach, reach)), persistent=False)
        self.reset_parameters()

    def bias_table(self) -> Tensor:
        """[heads, 2R - 1]: the bias of key - query distance r at column r + R - 1."""
        return self.relative_attention_bias.index_select(0, self.distance_buckets).t().contiguous()

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        batch, seq = input_ids.shape
        position_ids = (torch.arange(seq, device=input_ids.device) + self.config.position_offset).expand(batch, seq)
        x = self.embeddings(input_ids.reshape(-1), position_ids.reshape(-1), torch.zeros_like(input_ids).reshape(-1))
        reach = self.config.max_position_embeddings
        distance = torch.arange(seq, device=input_ids.device)
        bias = self.bias_table()[:, distance[None, :] - distance[:, None] + reach - 1]  # [heads, seq(q), seq(k)]
        attn_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, batch, seq, attn_mask, bias)
        return x.view(batch, seq, -1)

    attends_by_offsets = True  # the relative bias needs the fused op, which works from cu_seqlens everywhere

    def layer_context(self, attention: str) -> Tensor:
        return self.bias_table()


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    ops = ["embedding_layer_norm", "linear_add_layer_norm", "linear_bias_gelu"]
    if layout == "packed":
        ops += ["relative_attention", "segment_mean"]
    return tuple(ops)


MPNET = Family("mpnet", ("mpnet",), "MPNet", _read_mpnet, _MPNET_WEIGHTS,
               ClassifierHead("classifier.dense", "tanh", "classifier.out_proj"), encoder=Encoder,
               kernel_ops=kernel_ops, positions="learned absolute + relative bias", few_token_layer=False, fp8=True)
FAMILIES = (MPNET,)

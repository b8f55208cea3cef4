"""The BERT family: post-LN encoders with learned absolute positions and bidirectional attention. BERT, RoBERTa /
XLM-RoBERTa (positions counted from the padding index + 1, one token type) and DistilBERT (no token types, its own
weight names). This file is the family's room: its config.json reading, weight names, classification heads, layers
(composed from model/layers.py: the embeddings, the post-norm layer and encoder it shares with MPNet) and the kernels
they call (model/family.py says what a family declares).

Token-wise work runs on flattened [tokens, hidden] tensors through the fused `kernels.*` ops; GEMMs are plain torch
matmuls with their bias folded into the following fused op where one exists."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fusedserve import kernels
from fusedserve.model import layers, packing
from fusedserve.model.config import EncoderConfig, UnsupportedModel
from fusedserve.model.family import ClassifierHead, Family, MaskedLMHead, WeightLayout
from fusedserve.model.packing import FEW_TOKEN_OPS, FUSED_LAYER_TOKENS, Packed


# ---- config.json -------------------------------------------------------------------------------------------------

def _gelu_only(act: str, key: str) -> None:
    if act != "gelu":
        raise UnsupportedModel(f"{key} {act!r} is not supported (only exact GELU, 'gelu')")


def _positions(hf: dict, offset: bool) -> dict:
    pad = hf.get("pad_token_id", 0) if hf.get("pad_token_id") is not None else 0
    shift = pad + 1 if offset else 0  # RoBERTa counts positions from padding_idx + 1
    return dict(vocab_size=hf["vocab_size"], max_position_embeddings=hf["max_position_embeddings"], pad_token_id=pad,
                position_offset=shift, max_seq_length=hf["max_position_embeddings"] - shift)


def _read_bert(hf: dict, *, offset: bool = False) -> dict:
    _gelu_only(hf.get("hidden_act", "gelu"), "hidden_act")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModel(f"position_embedding_type {hf['position_embedding_type']!r} is not supported (only "
                               "absolute position embeddings)")
    return dict(hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
                type_vocab_size=hf.get("type_vocab_size", 2), layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
                **_positions(hf, offset))


def _read_roberta(hf: dict) -> dict:
    return _read_bert(hf, offset=True)


def _read_distilbert(hf: dict) -> dict:
    _gelu_only(hf.get("activation", "gelu"), "activation")
    if hf.get("sinusoidal_pos_embds"):
        raise UnsupportedModel("DistilBERT with sinusoidal position embeddings is not supported")
    return dict(hidden_size=hf["dim"], num_layers=hf["n_layers"], num_heads=hf["n_heads"],
                intermediate_size=hf["hidden_dim"], type_vocab_size=1, layer_norm_eps=1e-12,
                **_positions(hf, offset=False))


# ---- checkpoint names --------------------------------------------------------------------------------------------

_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings",
    "embeddings.LayerNorm.weight": "embeddings.ln_weight",
    "embeddings.LayerNorm.bias": "embeddings.ln_bias",
}
_BERT_LAYER = {
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
}
_DISTILBERT_LAYER = {
    "attention.out_lin.weight": "attn_out.weight",
    "attention.out_lin.bias": "attn_out.bias",
    "sa_layer_norm.weight": "attn_ln_weight",
    "sa_layer_norm.bias": "attn_ln_bias",
    "ffn.lin1.weight": "ffn_in.weight",
    "ffn.lin1.bias": "ffn_in.bias",
    "ffn.lin2.weight": "ffn_out.weight",
    "ffn.lin2.bias": "ffn_out.bias",
    "output_layer_norm.weight": "ffn_ln_weight",
    "output_layer_norm.bias": "ffn_ln_bias",
}
_BERT_WEIGHTS = WeightLayout(_EMBEDDINGS, "encoder.layer.", _BERT_LAYER,
                             ("attention.self.query", "attention.self.key", "attention.self.value"))
# DistilBERT has no token types: the encoder gets one all-zero token type (model.weights)
_DISTILBERT_WEIGHTS = WeightLayout({k: v for k, v in _EMBEDDINGS.items() if "token_type" not in k},
                                   "transformer.layer.", _DISTILBERT_LAYER,
                                   ("attention.q_lin", "attention.k_lin", "attention.v_lin"))


# ---- layers ------------------------------------------------------------------------------------------------------

def ffn_splits(inner: int, chunk: int = 64) -> int:
    """How many chunks the few-token layer splits its FFN into: the most that divide the intermediate width evenly
    without going under `chunk` columns (24 for MiniLM's 1536, 48 for BERT-base's 3072): one SM each."""
    return max(s for s in range(1, max(inner // chunk, 1) + 1) if inner % s == 0)


class Layer(layers.PostNormLayer):
    """The post-norm layer with SDPA / varlen attention, and the few-token layer for small batches."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config)
        self.ffn_splits = ffn_splits(config.intermediate_size)

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor) -> Tensor:
        # x: [batch * seq, hidden]; attn_mask: [batch, 1, 1, seq] bool, True = attend
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        return self.residual_blocks(x, packing.padded_attention(qkv, batch, seq, self.num_heads, attn_mask))

    def forward_packed(self, x: Tensor, p: Packed, attention: str = "pad") -> Tensor:
        """One layer on a packed batch: x [T, hidden] (real and filler tokens, no padding) -> [T, hidden]; attention
        "pad" (scatter into a padded block for SDPA), "varlen" (flash attention over cu_seqlens) or "fused" (the
        few-token layer for small batches, else varlen or qkv_attention)."""
        if attention == "fused":  # dense batches too (their offsets are regular)
            if x.shape[0] <= FUSED_LAYER_TOKENS:
                return self._few_token_layer(x, p)
            if not packing.varlen_runs(x.device, x.dtype):
                ctx = kernels.qkv_attention(x, self.qkv.weight, self.qkv.bias, p.cu_seqlens, p.seq, self.num_heads)
                return self.residual_blocks(x, ctx)
            # larger batches where varlen runs: cuBLAS QKV + varlen flash attention (qkv_attention re-projects a
            # longer sequence's keys per query block, slower at 128-token sequences)
            attention = "varlen"
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        return self.residual_blocks(x, packing.packed_attention(qkv, p, self.num_heads, attention))

    def _few_token_layer(self, x: Tensor, p: Packed) -> Tensor:
        # four kernels where the blocks above take eight: attention with each head's share of the output projection,
        # then the FFN split over its intermediate width, each as fp32 partial sums that a LayerNorm kernel adds up
        # with the bias and the residual (kernels/triton/qkv_attention.py, ffn_partials.py)
        parts = kernels.attention_partials(x, self.qkv.weight, self.qkv.bias, p.cu_seqlens, p.seq, self.num_heads,
                                           self.attn_out.weight)
        x = kernels.partial_add_layer_norm(parts, self.attn_out.bias, x, self.attn_ln_weight, self.attn_ln_bias,
                                           self.eps)
        parts = kernels.ffn_partials(x, self.ffn_in.weight, self.ffn_in.bias, self.ffn_out.weight, self.ffn_splits)
        return kernels.partial_add_layer_norm(parts, self.ffn_out.bias, x, self.ffn_ln_weight, self.ffn_ln_bias,
                                              self.eps)

    def attend(self, qkv: Tensor, p: Packed, attention: str) -> Tensor:
        """The FP8 layer's attention ("pad" or "varlen")."""
        return packing.packed_attention(qkv, p, self.num_heads, attention)


class Encoder(layers.PostNormEncoder):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config, layers.Embeddings(config), (Layer(config) for _ in range(config.num_layers)))
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        # input_ids, attention_mask, token_type_ids: [batch, seq] -> hidden states [batch, seq, hidden]
        batch, seq = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        position_ids = (torch.arange(seq, device=input_ids.device) + self.config.position_offset).expand(batch, seq)
        x = self.embeddings(input_ids.reshape(-1), position_ids.reshape(-1), token_type_ids.reshape(-1))
        attn_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, batch, seq, attn_mask)
        return x.view(batch, seq, -1)


def kernel_ops(layout: str, attention: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The `kernels.*` ops a forward calls in this layout ("packed" or "padded") and attention mode (resolved: pad,
    varlen or fused) on this device and dtype. The registry self-tests and races these only; the rest stay on the
    reference, untested."""
    ops = ["embedding_layer_norm", "linear_add_layer_norm", "linear_bias_gelu"]
    if layout == "packed":
        ops.append("segment_mean")  # pooling over cu_seqlens
        if attention == "fused":  # the few-token layer; above FUSED_LAYER_TOKENS varlen, or qkv_attention where
            ops += list(FEW_TOKEN_OPS)  # varlen does not run
            ops += [] if packing.varlen_runs(device, dtype) else ["qkv_attention"]
    return tuple(ops)


# ---- the declarations ------------------------------------------------------------------------------------------

_COMMON = dict(encoder=Encoder, kernel_ops=kernel_ops, fp8=True)
BERT = Family("bert", ("bert",), "BERT", _read_bert, _BERT_WEIGHTS,
              ClassifierHead("pooler.dense", "tanh", "classifier"),
              masked_lm=MaskedLMHead("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                                     "cls.predictions.decoder", "cls.predictions.bias"), **_COMMON)
ROBERTA = Family("roberta", ("roberta", "xlm-roberta"), "RoBERTa / XLM-RoBERTa", _read_roberta, _BERT_WEIGHTS,
                 ClassifierHead("classifier.dense", "tanh", "classifier.out_proj"),
                 masked_lm=MaskedLMHead("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder", "lm_head.bias"),
                 **_COMMON)
DISTILBERT = Family("distilbert", ("distilbert",), "DistilBERT", _read_distilbert, _DISTILBERT_WEIGHTS,
                    ClassifierHead("pre_classifier", "relu", "classifier"),
                    masked_lm=MaskedLMHead("vocab_transform", "vocab_layer_norm", "vocab_projector",
                                           "vocab_projector.bias"), **_COMMON)
FAMILIES = (BERT, ROBERTA, DISTILBERT)

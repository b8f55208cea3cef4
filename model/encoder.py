"""The BERT encoder (post-LN). Token-wise work runs on flattened [tokens, hidden] tensors through the
fused `kernels.*` ops; GEMMs are plain torch matmuls with their bias folded into the following fused op
where one exists; attention is torch SDPA with a key-padding mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from model.config import EncoderConfig


class Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Parameter(torch.empty(config.vocab_size, h))
        self.position_embeddings = nn.Parameter(torch.empty(config.max_position_embeddings, h))
        self.token_type_embeddings = nn.Parameter(torch.empty(config.type_vocab_size, h))
        self.ln_weight = nn.Parameter(torch.ones(h))
        self.ln_bias = nn.Parameter(torch.zeros(h))
        self.eps = config.layer_norm_eps

    def forward(self, input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        # ids: [tokens] -> [tokens, hidden]
        return kernels.embedding_layer_norm(
            input_ids, position_ids, token_type_ids, self.word_embeddings, self.position_embeddings,
            self.token_type_embeddings, self.ln_weight, self.ln_bias, self.eps,
        )


class Layer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.num_heads, self.head_dim, self.eps = config.num_heads, config.head_dim, config.layer_norm_eps
        self.qkv = nn.Linear(h, 3 * h)  # query, key, value stacked: one GEMM
        self.attn_out = nn.Linear(h, h)
        self.attn_ln_weight = nn.Parameter(torch.ones(h))
        self.attn_ln_bias = nn.Parameter(torch.zeros(h))
        self.ffn_in = nn.Linear(h, i)
        self.ffn_out = nn.Linear(i, h)
        self.ffn_ln_weight = nn.Parameter(torch.ones(h))
        self.ffn_ln_bias = nn.Parameter(torch.zeros(h))

    def forward(self, x: Tensor, batch: int, seq: int, attn_mask: Tensor) -> Tensor:
        # x: [batch * seq, hidden]; attn_mask: [batch, 1, 1, seq] bool, True = attend
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        # [tokens, 3*hidden] -> 3 x [batch, heads, seq, head_dim]
        q, k, v = qkv.view(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        ctx = ctx.transpose(1, 2).reshape(batch * seq, -1)
        # post-LN residual blocks: x = LN(x + dense(ctx) + b); x = LN(x + W2 gelu(W1 x + b1) + b2)
        x = kernels.add_layer_norm(F.linear(ctx, self.attn_out.weight), x, self.attn_out.bias,
                                   self.attn_ln_weight, self.attn_ln_bias, self.eps)
        h = kernels.bias_gelu(F.linear(x, self.ffn_in.weight), self.ffn_in.bias)
        return kernels.add_layer_norm(F.linear(h, self.ffn_out.weight), x, self.ffn_out.bias,
                                      self.ffn_ln_weight, self.ffn_ln_bias, self.eps)


class Encoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """BERT's initialisation (normal(0, 0.02) matrices, zero biases, unit LayerNorm) from a fixed seed."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if "ln_weight" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        # input_ids, attention_mask, token_type_ids: [batch, seq] -> hidden states [batch, seq, hidden]
        batch, seq = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        x = self.embeddings(input_ids.reshape(-1), position_ids.reshape(-1), token_type_ids.reshape(-1))
        attn_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, batch, seq, attn_mask)
        return x.view(batch, seq, -1)


def mean_pool(hidden: Tensor, attention_mask: Tensor, normalize: bool) -> Tensor:
    """Mean over real tokens (as sentence-transformers' Pooling), optionally L2-normalized: [batch, hidden]."""
    hidden = hidden.float()
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=1) if normalize else pooled

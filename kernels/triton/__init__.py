"""Triton implementations of the fused ops, one launcher per file (see _norm.py and _pointwise.py for the
shared kernels). Importing this package imports triton; the registry does so only when probing."""

from kernels.triton.add_layer_norm import add_layer_norm, partial_add_layer_norm
from kernels.triton.bias_gelu import bias_gelu
from kernels.triton.bias_residual_gelu import bias_residual_gelu
from kernels.triton.embedding_layer_norm import embedding_layer_norm
from kernels.triton.ffn_partials import ffn_partials
from kernels.triton.layer_norm import layer_norm
from kernels.triton.layer_norm_gelu import layer_norm_gelu
from kernels.triton.linear_gelu import linear_bias_gelu
from kernels.triton.linear_layer_norm import linear_add_layer_norm
from kernels.triton.qkv_attention import attention_partials, qkv_attention
from kernels.triton.segment_mean import segment_mean

LAUNCHERS = {
    "layer_norm": layer_norm,
    "layer_norm_gelu": layer_norm_gelu,
    "bias_gelu": bias_gelu,
    "bias_residual_gelu": bias_residual_gelu,
    "add_layer_norm": add_layer_norm,
    "embedding_layer_norm": embedding_layer_norm,
    "linear_bias_gelu": linear_bias_gelu,  # one GEMM with the bias + GELU epilogue
    "linear_add_layer_norm": linear_add_layer_norm,  # cuBLAS + add_layer_norm (the split kernel: opt-in)
    "segment_mean": segment_mean,  # mean pooling of a packed batch
    "qkv_attention": qkv_attention,  # QKV projection + attention per packed sequence (Triton only)
    # a few tokens' layer in four kernels (Triton only): attention + output projection and the FFN as partial sums,
    # each finished by a LayerNorm over the sum
    "attention_partials": attention_partials,
    "ffn_partials": ffn_partials,
    "partial_add_layer_norm": partial_add_layer_norm,
}

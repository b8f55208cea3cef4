"""Triton implementations of the fused ops, one launcher per file (see _norm.py and _pointwise.py for the
shared kernels). Importing this package imports triton; the registry does so only when probing."""

from fusedserve.kernels.triton.add_layer_norm import add_layer_norm, partial_add_layer_norm
from fusedserve.kernels.triton.bias_gelu import bias_gelu
from fusedserve.kernels.triton.bias_residual_gelu import bias_residual_gelu
from fusedserve.kernels.triton.embedding_layer_norm import embedding_layer_norm
from fusedserve.kernels.triton.ffn_partials import ffn_partials
from fusedserve.kernels.triton.layer_norm import layer_norm
from fusedserve.kernels.triton.layer_norm_gelu import layer_norm_gelu
from fusedserve.kernels.triton.linear_gelu import linear_bias_gelu
from fusedserve.kernels.triton.linear_layer_norm import linear_add_layer_norm
from fusedserve.kernels.triton.qkv_attention import attention_partials, qkv_attention
from fusedserve.kernels.triton.segment_mean import segment_mean

from fusedserve.kernels.spec import ops_of

# {op: launcher} for the ops kernels.spec lists as implemented in Triton
LAUNCHERS = {op: globals()[op] for op in ops_of("triton")}

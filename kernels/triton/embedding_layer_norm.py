"""Triton embedding + LayerNorm: gather word, position and token-type rows, sum, normalize; one kernel
for the encoder's first step (the LayerNorm family's kernel, its rows gathered by id). Ids must be in range (the
tokenizer and the server's validation ensure it)."""

from __future__ import annotations

from torch import Tensor

from fusedserve.kernels._layout import embedding_inputs
from fusedserve.kernels.triton._common import as_vector, check_device
from fusedserve.kernels.triton._gelu import GELU_NONE
from fusedserve.kernels.triton._norm import launch_norm


def embedding_layer_norm(input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor, word_embeddings: Tensor,
                         position_embeddings: Tensor, token_type_embeddings: Tensor, weight: Tensor, bias: Tensor,
                         eps: float = 1e-12, *, out: Tensor | None = None) -> Tensor:
    check_device("embedding_layer_norm", word_embeddings, position_embeddings, token_type_embeddings, weight, bias)
    name = "embedding_layer_norm"
    ids, pos, types, word, position, token_type, y, shape = embedding_inputs(
        input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings, out)
    cols = y.shape[1]
    launch_norm(word, position, None, as_vector(weight, cols, f"{name} weight"), as_vector(bias, cols, f"{name} bias"),
                y, None, eps, GELU_NONE, gather=(ids, pos, types, token_type))
    return out if out is not None else y.view(shape)

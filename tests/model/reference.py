"""sentence-transformers' encode as the tests' reference, without the padding its batches carry.

SentenceTransformer.encode pads each batch to its longest input (its batches are sorted by characters, not tokens),
and the padded positions cost as much as real ones: a batch of three texts of 18, 3 and 384 tokens runs 3 x 384. At
a base shape on a CPU core that padding is most of the reference's time (all-mpnet-base-v2's 200 texts: 38 s in
batches of 8, 24 s unpadded). encode_unpadded calls encode once per token count, on every text of that count, so no
batch holds a padded position; each text's embedding is the one encode gives it in any batch (the padding is masked
out), up to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def encode_unpadded(model, texts: Sequence[str], **kwargs) -> torch.Tensor:
    """model.encode(texts, convert_to_tensor=True, **kwargs) (a SentenceTransformer), in the order of `texts`, each
    call on texts of one token count as the model tokenizes them (truncated at its max_seq_length)."""
    texts = list(texts)
    counts = model.tokenize(texts)["attention_mask"].sum(dim=1).tolist()
    groups: dict[int, list[int]] = {}
    for i, count in enumerate(counts):
        groups.setdefault(count, []).append(i)
    rows: list[torch.Tensor | None] = [None] * len(texts)
    for members in groups.values():
        out = model.encode([texts[i] for i in members], batch_size=len(members), convert_to_tensor=True, **kwargs)
        for i, row in zip(members, out):
            rows[i] = row
    return torch.stack(rows)

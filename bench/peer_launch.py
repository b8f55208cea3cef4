"""Infinity's CLI (`python -m bench.peer_launch v2 ...`, the peer server of bench/peer.py) with the one patch it needs
on transformers 5: run from Infinity's own install folder, which bench/peer.py puts first on this process's path."""

from __future__ import annotations

import sys

from transformers import PreTrainedTokenizerBase

# transformers 5 removed batch_encode_plus; Infinity 0.0.78 counts tokens with it (in its start-up warm-up, and per
# request with lengths_via_tokenize) and reads `.encodings` of the result, which calling the tokenizer gives as well
if not hasattr(PreTrainedTokenizerBase, "batch_encode_plus"):
    def batch_encode_plus(self, batch_text_or_text_pairs, **kwargs):
        return self(batch_text_or_text_pairs, **kwargs)

    PreTrainedTokenizerBase.batch_encode_plus = batch_encode_plus

if __name__ == "__main__":
    from infinity_emb.cli import cli

    sys.argv[0] = "infinity_emb"
    cli()

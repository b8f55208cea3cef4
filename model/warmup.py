"""The start-up's batches: which token-id batches a model runs before traffic so that no request pays a one-time
cost (a compile, an autotune, the allocator's first growth). Planning only: the model's owner runs them
(model.served.Served.warm_up)."""

from __future__ import annotations

from dataclasses import dataclass

from fusedserve.model.tokenizer import TextTokenizer


@dataclass(frozen=True)
class WarmupPlanner:
    """For a model taking inputs of up to `max_seq_length` tokens through `tokenizer`, in batches of at most
    `max_batch` rows and `max_batch_tokens` tokens."""

    tokenizer: TextTokenizer
    max_seq_length: int
    max_batch_tokens: int
    max_batch: int

    def _longest(self) -> list[int]:
        # truncated to max_seq_length, special tokens included
        return self.tokenizer.encode(["warm up " * self.max_seq_length])[0]

    def warmup_batches(self) -> list[list[list[int]]]:
        """Token-id batches that make a first forward pay its one-time costs before traffic: the largest batch of
        full-length inputs the batch limits allow, and a single short input."""
        longest = self._longest()
        rows = max(1, min(self.max_batch, self.max_batch_tokens // len(longest)))
        return [[longest] * rows, self.tokenizer.encode(["warm up"])]

    def shape_sweep(self) -> list[list[list[int]]]:
        """Token-id batches whose eager forwards meet every launch shape a served batch can, for the start-up to run
        before traffic (`embed_ids(batch, graphs=False)`): then no request's eager forward (a kernel-timed sample, a
        batch outside every graph bucket, serving without CUDA graphs) pays an autotune or a compile.

        Per power-of-two bucket of the token count (the key of every tuned launch config, kernels.row_bucket), up to
        max_batch_tokens: its first count (a power of two) and the next, as full rows of the model's longest input
        (rows of equal length take the dense path) and, where two rows fit, as two rows of unequal length (the masked
        path). FUSED_LAYER_TOKENS (a power of two) is the first count of its bucket, so the next one, the first of the
        layered path, is swept too (its kernels tune their own keys in the same bucket).

        The Triton kernels take their counts unspecialized (kernels.triton._common.autotune), but not the alignment
        of their pointers: the packed batch's index rows are views of one buffer, 16-byte aligned only for an even
        token count, so each bucket's config is compiled for both parities."""
        longest = self._longest()
        seq = len(longest)
        most = min(self.max_batch_tokens, self.max_batch * seq)

        def rows_of(tokens: int) -> list[list[int]]:
            full, rest = divmod(tokens, seq)
            return [longest] * full + ([longest[:rest]] if rest else [])

        firsts = [1 << (bits - 1) for bits in range(1, most.bit_length() + 1)]  # each bucket's first count
        counts = sorted({c for first in firsts for c in (first, first + 1) if c <= most})
        batches = []
        for tokens in counts:
            batches.append(rows_of(tokens))
            if 3 <= tokens <= seq:  # two unequal rows (more than a row's worth already makes them)
                short = (tokens - 1) // 2
                batches.append([longest[:tokens - short], longest[:short]])
        return batches

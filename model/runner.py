"""Turns texts or token ids into pooled embeddings: the Embedder is one model on one device, made of parts that each
have one duty. model.loading reads a preset or a checkpoint and decides the device and dtype (Embedder.load);
model.kernel_path owns the kernel selection, the attention mode and the precision, and is the only way anything
outside changes the path (set_fused, fall_back, fall_back_precision, use), always between forwards; model.forwards
runs the eager and CUDA-graph forwards and the kernel-timed ones; model.warmup plans the start-up's batches;
model.describing says what the model is and runs on. The Embedder itself is the text API over them: texts (prompts,
pairs, truncation: model.tokenizer.TextPreparation) become token ids, token ids become vectors."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from fusedserve.model import colbert as colbert_model
from fusedserve.model import describing, loading
from fusedserve.model.api import BATCH_INPUTS, Rows, TextOptions, batch_tokens, l2_normalize
from fusedserve.model.families import family
from fusedserve.model.forwards import Forwards, Pending
from fusedserve.model.kernel_path import KernelPath
from fusedserve.model.loading import LoadReport
from fusedserve.model.modules import (M3_DROPPED, Classifier, EmbeddingHead, M3Head, Pipeline, SparseHead,
                                      classification_head)
from fusedserve.model.tokenizer import PairIds, TextPreparation, TextTokenizer
from fusedserve.model.warmup import WarmupPlanner

__all__ = ["Embedder", "LoadReport", "Pending"]


class Embedder:
    """One encoder on one device, the head that follows it and its text preparation; its parts: `kernel_path`
    (KernelPath), `forwards` (Forwards, with `graphs`: its CUDA graphs or None) and `warmup` (WarmupPlanner). Not
    thread-safe: one worker calls it (the server's batcher); a second thread gets its own copy (reference_copy)."""

    def __init__(self, encoder: torch.nn.Module, tokenizer: TextTokenizer | None, name: str,
                 device: torch.device, dtype: torch.dtype, *, pipeline: Pipeline | None = None,
                 classifier: Classifier | None = None, layout: str = "packed", attention: str = "auto",
                 cuda_graphs: bool = True, max_batch_tokens: int | None = None, max_batch: int = BATCH_INPUTS,
                 max_graphs: int = 256, backend: str = "auto", backend_overrides: dict[str, str] | None = None,
                 precision: str = "native") -> None:
        if layout not in ("packed", "padded"):
            raise ValueError(f"layout must be packed or padded, got {layout!r}")
        if max_batch_tokens is None:
            max_batch_tokens = batch_tokens(device.type == "cuda")
        self.encoder = encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.config = encoder.config
        self.family = family(self.config)
        self.tokenizer = tokenizer
        # what follows the encoder: an embedding pipeline (pooling, Dense, Normalize, prompts) or a classifier; the
        # head stays float32 whatever the encoder's dtype
        self.pipeline = pipeline if classifier is None else None
        self.classifier = classifier
        if classifier is not None:
            head: torch.nn.Module = classification_head(classifier)
        else:
            self.pipeline = self.pipeline or Pipeline(normalize=self.config.normalize)
            if self.pipeline.sparse is not None:  # a SPLADE model: its decoder is the encoder's word embeddings
                head = SparseHead(self.pipeline.sparse, self.encoder.embeddings.word_embeddings, dtype)
            elif self.pipeline.colbert is not None:  # a ColBERT model: its projection, per token (model.colbert)
                head = colbert_model.ColbertHead(self.pipeline.colbert, colbert_model.colbert_text(
                    self.pipeline.colbert, tokenizer, self.config.vocab_size), self.config.hidden_size)
            else:
                head = EmbeddingHead(self.pipeline, self.config.hidden_size)
        self.head = head.to(device).eval().requires_grad_(False)
        # a ColBERT model's text rules (markers, lengths, expansion, skiplist), None for any other
        self.colbert = head.text if isinstance(head, colbert_model.ColbertHead) else None
        # BGE-M3's other outputs, from the per-token states on the device (FlagEmbedding drops these specials' weights)
        self.m3 = M3Head(self.pipeline.m3, tokenizer.special_ids(M3_DROPPED) if tokenizer is not None else (),
                         dtype).to(device).eval() if self.pipeline is not None and self.pipeline.m3 else None
        self.kind = "classifier" if classifier is not None else "sparse" if self.pipeline.sparse else "embedding"
        # the one place inputs become token ids (prompts, lower-casing, pairs, truncation)
        self.text = TextPreparation(
            tokenizer, self.config.vocab_size, lower_case=self.pipeline is not None and self.pipeline.do_lower_case,
            prompts=self.pipeline.prompts if self.pipeline is not None else None,
            default_prompt_name=self.pipeline.default_prompt_name if self.pipeline is not None else None,
            pair_template=classifier.template if classifier is not None else None, colbert=self.colbert,
        ) if tokenizer is not None else None
        self.dim: int = head.dim
        self.name, self.device, self.dtype, self.layout = name, device, dtype, layout
        self.max_batch_tokens, self.max_batch = max_batch_tokens, max_batch
        self.kernel_path = KernelPath(self.encoder, self.family, device, dtype, name=name, layout=layout,
                                      attention=attention, head_ops=self.head.ops + (self.m3.ops if self.m3 else ()), backend=backend,
                                      backend_overrides=backend_overrides, precision=precision)
        # a cross-encoder's text pairs carry token types (the second text's: 1) where the model has them
        self.forwards = Forwards(self.encoder, self.head, self.kernel_path,
                                 pair_types=classifier is not None and self.config.type_vocab_size > 1,
                                 cuda_graphs=cuda_graphs and self.colbert is None,  # no pooled rows served
                                 max_batch_tokens=max_batch_tokens, max_batch=max_batch,
                                 max_graphs=max_graphs)
        self.graphs = self.forwards.graphs
        self.kernel_path.graphs = self.graphs  # each new selection retargets them (or drops what they captured)
        self.warmup = WarmupPlanner(tokenizer, self.config.max_seq_length, max_batch_tokens, max_batch)

    @classmethod
    def load(cls, model: str = "default", *, device: str = "auto", dtype: str = "auto", fused: bool = True,
             max_seq_length: int | None = None, pooling: str | None = None, name: str | None = None,
             **options) -> tuple[Embedder, LoadReport]:
        """model: "default" (the packaged all-MiniLM-L6-v2), a preset name (random init, default tokenizer),
        or a checkpoint directory (an embedding model, sentence-transformers or plain Hugging Face, a
        `*ForSequenceClassification` classifier / cross-encoder, or a yes/no reranker's `*ForCausalLM`). pooling:
        override an embedding model's pooling (cls, mean, max, mean_sqrt_len_tokens, lasttoken). name: what it is
        called (default: the preset's name, "all-MiniLM-L6-v2", or the directory's name). options: layout, attention,
        cuda_graphs, max_batch_tokens, max_batch, max_graphs, backend, backend_overrides, precision (see
        __init__). The kernel selection is made (fused: or every op on the reference) before it returns."""
        return loading.load(cls, model, device=device, dtype=dtype, fused=fused, max_seq_length=max_seq_length,
                            pooling=pooling, name=name, **options)

    def reference_copy(self) -> Embedder:
        """An fp32 copy of this model on the same device, every op on the torch reference, no CUDA graphs: for a
        background thread's checks (the copy is that thread's own; this Embedder stays the worker's)."""
        # the fp8 weights (not parameters) stay behind: the copy runs the reference (memo: what deepcopy gives for them)
        encoder = copy.deepcopy(self.encoder, memo={id(getattr(self.encoder, "fp8_weights", None)): None}).float()
        if hasattr(encoder, "precision"):
            encoder.precision = "native"
        return Embedder(encoder, self.tokenizer, self.name, self.device, torch.float32, pipeline=self.pipeline,
                        classifier=self.classifier, layout=self.layout, cuda_graphs=False)

    def describe(self) -> dict:
        """The model's kernel state for /info and the fused switch's answer (model.describing.state)."""
        return describing.state(self)

    # ---- token ids in -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def embed_ids(self, batch: Rows | list[list[int]], normalize: bool | None = None, *, graphs: bool = True,
                  reference: bool = False) -> Tensor:
        """Pooled embeddings [len(batch), dim] (float32, on the CPU) for token-id rows of any lengths.
        graphs=False runs the eager forward (the graphs' oracle in tests and benchmarks). reference=True runs this
        one batch eagerly on the torch reference (the worker's re-run of a batch whose fused forward failed); the
        path stays as it is. normalize: None follows the model's pipeline (its Normalize module)."""
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)
        if reference:
            pooled = self.forwards.on_reference(batch)
        else:
            pooled = self.launch_ids(batch, graphs=graphs).wait()
        if normalize is None:
            normalize = self.pipeline.normalize if self.pipeline is not None else False
        return torch.from_numpy(l2_normalize(pooled.numpy())) if normalize else pooled

    def launch_ids(self, batch: Rows | list[list[int]], *, graphs: bool = True) -> Pending:
        """Start the forward of `batch`; `Pending.wait()` gives its unnormalized output rows (Forwards.launch_ids)."""
        return self.forwards.launch_ids(batch, graphs=graphs)

    def timed_steps(self, batch: Rows | list[list[int]], callback: Callable[[str, str, float], None]) -> Iterator[None]:
        """`batch`'s eager forward one step at a time, every op call timed (Forwards.timed_steps)."""
        return self.forwards.timed_steps(batch, callback)

    # ---- text in: through TextPreparation, the one place inputs become ids -----------------------------------
    def prompt(self, prompt_name: str | None) -> str:
        """The text a prompt name stands for ("" for none; the model's default prompt when not named)."""
        return self.text.prompt(prompt_name)

    def tokenize(self, texts: list[str], truncate: bool = True, prompt_name: str | None = None) -> list[list[int]]:
        """Token ids of texts as sentence-transformers makes them (model.tokenizer.TextPreparation.texts)."""
        return self.text.texts(texts, TextOptions(truncate=truncate, prompt_name=prompt_name)).tolist()

    def tokenize_pairs(self, pairs: list[tuple[str, str]], truncate: bool = True) -> list[list[int]]:
        """Token ids of text pairs as a cross-encoder takes them (longest_first truncation), each row knowing where
        its second text starts."""
        rows = self.text.pairs(pairs, TextOptions(truncate=truncate))
        return [PairIds(row, int(second)) for row, second in zip(rows.tolist(), rows.second)]

    def embed(self, texts: list[str], normalize: bool | None = None, truncate: bool = True,
              prompt_name: str | None = None) -> Tensor:
        """Embeddings [len(texts), dim] float32 on the CPU, normalized as the model's pipeline says unless
        `normalize` says otherwise."""
        if self.colbert is not None:
            raise ValueError(f"{self.name} is a ColBERT model: it gives one vector per token (launch with output "
                             "'colbert'), not one per text")
        return self.embed_ids(self.text.texts(texts, TextOptions(truncate=truncate, prompt_name=prompt_name)),
                              normalize)

    def predict(self, pairs: list[tuple[str, str]] | list[str], truncate: bool = True) -> Tensor:
        """A classifier's logits [n, num_labels] float32 for text pairs (or single texts)."""
        if self.kind != "classifier":
            raise ValueError(f"{self.name} is an embedding model, not a classifier")
        inputs = [tuple(p) if not isinstance(p, str) else p for p in pairs]
        return self.embed_ids(self.text.prepare(inputs, TextOptions(truncate=truncate)), normalize=False)

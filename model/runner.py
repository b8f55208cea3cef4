"""Turns texts or token ids into pooled embeddings: tokenize, pack (or pad) the batch, forward, pool.
Device, dtype, layout, CUDA graphs and the kernel selection are decided here, at load; the Embedder owns its
kernel Selection and is the only way anything outside changes the path (set_fused, fall_back, use), always
between forwards.

Layouts: "packed" (serving) runs the real tokens of the batch back to back, no padding (model.packing.Packed);
"padded" pads every row to the longest, the classic layout, kept as the tests' oracle. On a CUDA device the packed
forward is replayed from CUDA graphs per shape bucket (model.graphs) unless graphs are off; batches outside the
buckets, reference re-runs and timed batches run eagerly."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fusedserve import kernels
from fusedserve.kernels import fp8
from fusedserve.kernels.registry import REFERENCE_BACKEND
from fusedserve.kernels.timing import OpTimer
from fusedserve.model.api import Rows, TextOptions, l2_normalize, name_of
from fusedserve.model.config import PRESETS, EncoderConfig, UnsupportedModel
from fusedserve.model.packing import FEW_TOKEN_OPS, FUSED_LAYER_TOKENS, Packed, resolve_attention
from fusedserve.model.families import family
from fusedserve.model.modules import (Classifier, EmbeddingHead, Pipeline, SparseHead, classification_head,
                                     masked_lm_tensors, read_classifier, read_pipeline)
from fusedserve.model.tokenizer import PairIds, TextPreparation, TextTokenizer
from fusedserve.model.weights import CheckpointError, check_encoder_only, default_model_dir, load_checkpoint

log = logging.getLogger("fusedserve.model")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PRECISIONS = ("native", "fp8")  # the GEMMs in the model's dtype, or in FP8 with the rest in it (kernels.fp8)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available here")
    return resolved


# The CPU instructions that compute each half type natively (Linux /proc/cpuinfo flag names). Without them oneDNN
# and torch's CPU kernels convert each element to fp32 and back: the half type then only costs time and accuracy.
CPU_HALF_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is not there to read), read once: /info asks each time."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_half_isa(dtype: torch.dtype) -> list[str]:
    """The flags of CPU_HALF_FLAGS[dtype] this CPU has (AMX first): what runs a half type's matmuls here."""
    flags = cpu_flags()
    return [flag for flag in CPU_HALF_FLAGS.get(dtype, ()) if flag in flags]


def cpu_isa(device: torch.device, dtype: torch.dtype) -> str | None:
    """On the CPU, the instructions its matmuls run on: a half type's (AMX or AVX-512, cpu_half_isa), else
    torch's vectorized-kernel level ("AVX512", "AVX2"); None on a GPU."""
    if device.type != "cpu":
        return None
    half = cpu_half_isa(dtype)
    return half[0] if half else torch.backends.cpu.get_cpu_capability()


def resolve_dtype(dtype: str, device: torch.device, on_cuda: torch.dtype = torch.float16) -> torch.dtype:
    """auto: float32 on the CPU, on a GPU `on_cuda` (the model family's: model.family.Family.dtype_on_cuda). A half
    type on the CPU is the opt-in lower-precision path, refused where the CPU has no instructions for it."""
    if dtype == "auto":
        return on_cuda if device.type == "cuda" else torch.float32
    try:
        resolved = DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}") from None
    if device.type == "cpu" and resolved in CPU_HALF_FLAGS and not cpu_half_isa(resolved):
        raise ValueError(f"dtype {dtype} on the CPU needs a CPU with {' or '.join(CPU_HALF_FLAGS[resolved])} "
                         f"(this one has neither: its {dtype} would run emulated, slower than float32); use float32")
    return resolved


@dataclass(frozen=True)
class LoadReport:
    model: str
    device: torch.device
    dtype: torch.dtype
    config: EncoderConfig
    kernels: kernels.Selection
    seconds: float
    head: str = ""
    source: str = ""  # " (random init)" for a preset

    def __str__(self) -> str:
        c = self.config
        return (
            f"model {self.model}{self.source}: {c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}, "
            f"max_seq_length {c.max_seq_length}, architecture {c.architecture} ({family(c).describe()})\n{self.head}\n"
            f"device {self.device}, dtype {str(self.dtype).removeprefix('torch.')}, loaded in {self.seconds:.1f}s\n"
            f"{self.kernels.report()}"
        )


class Pending:
    """A forward in flight: `wait()` blocks until its result is on the host and returns it."""

    __slots__ = ("_result", "_done")

    def __init__(self, result: Tensor, done: torch.cuda.Event | None = None) -> None:
        self._result, self._done = result, done

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def wait(self) -> Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._result


class Embedder:
    """Owns one encoder on one device and its kernel selection. Not thread-safe: one worker calls it (the server's
    batcher); a second thread gets its own copy (reference_copy)."""

    def __init__(self, encoder: torch.nn.Module, tokenizer: TextTokenizer | None, name: str,
                 device: torch.device, dtype: torch.dtype, *, pipeline: Pipeline | None = None,
                 classifier: Classifier | None = None, layout: str = "packed", attention: str = "auto",
                 cuda_graphs: bool = True, max_batch_tokens: int = 8192, max_batch: int = 256,
                 max_graphs: int = 256, backend: str = "auto", backend_overrides: dict[str, str] | None = None,
                 precision: str = "native") -> None:
        if layout not in ("packed", "padded"):
            raise ValueError(f"layout must be packed or padded, got {layout!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
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
            else:
                head = EmbeddingHead(self.pipeline, self.config.hidden_size)
        self.head = head.to(device).eval().requires_grad_(False)
        self.kind = "classifier" if classifier is not None else "sparse" if self.pipeline.sparse else "embedding"
        # the one place inputs become token ids (prompts, lower-casing, pairs, truncation)
        self.text = TextPreparation(
            tokenizer, self.config.vocab_size, lower_case=self.pipeline is not None and self.pipeline.do_lower_case,
            prompts=self.pipeline.prompts if self.pipeline is not None else None,
            default_prompt_name=self.pipeline.default_prompt_name if self.pipeline is not None else None,
            pair_template=classifier.template if classifier is not None else None,
        ) if tokenizer is not None else None
        self.dim: int = head.dim
        # a cross-encoder's text pairs carry token types (the second text's: 1) where the model has them
        self.pair_types = classifier is not None and self.config.type_vocab_size > 1
        self.name, self.device, self.dtype = name, device, dtype
        self.layout = layout
        self.max_batch_tokens, self.max_batch = max_batch_tokens, max_batch
        self.backend, self.backend_overrides = backend, dict(backend_overrides or {})
        # packed batches only: auto = the few-token layer + varlen flash attention in fp16/bf16 on CUDA (varlen alone
        # while the few-token ops are on the reference: _attention_for), one SDPA per sequence on the CPU, else
        # pad-for-SDPA
        self.requested_attention = attention if layout == "packed" else "pad"
        self.attention, self.attention_reason = self._attention_for(None)
        self.selection = kernels.reference_selection(device, (dtype,), "not selected yet")
        self.fallback: str | None = None  # why the path fell back to the reference (fall_back), until set_fused
        self._reference = kernels.reference_selection(device, (dtype,), "reference re-run")
        self._observer: kernels.Observer | None = None  # set inside timed()
        # the precision asked for, and why it fell back to the fp16 (native) path: the verifier's sustained FP8
        # mismatches (fall_back_precision), until set_fused
        self.precision, self.precision_fallback = precision, None
        self.fp8_bytes = self._enable_fp8() if precision == "fp8" else 0
        self.graphs = None
        if cuda_graphs and layout == "packed" and device.type == "cuda":
            from fusedserve.model.graphs import CudaGraphs

            self.graphs = CudaGraphs(self.encoder, device, max_tokens=max_batch_tokens, max_batch=max_batch,
                                     max_graphs=max_graphs, head=self.head, attention=self.attention,
                                     **self._token_layout())

    def _enable_fp8(self) -> int:
        """Check that this model can run PRECISION=fp8 here (raises UnsupportedModel naming what cannot), run the
        FP8 ops' self-test and quantize the GEMM weights; returns their bytes."""
        refused = fp8.unavailable(self.device)
        if refused is None and not self.family.fp8:
            refused = (f"{self.family.label} models have no FP8 path (BERT, RoBERTa / XLM-RoBERTa, DistilBERT and "
                       "MPNet do)")
        if refused is None and self.layout != "packed":
            refused = "the padded layout (the tests' oracle) has no FP8 path"
        if refused is None:
            try:
                fp8.self_test(self.device, self.dtype, (self.config.hidden_size, self.config.intermediate_size))
                return self.encoder.quantize_fp8()
            except fp8.Fp8Unavailable as exc:
                refused = str(exc)
        raise UnsupportedModel(f"PRECISION=fp8 cannot serve {self.name}: {refused}")

    @classmethod
    def load(
        cls,
        model: str = "default",
        *,
        device: str = "auto",
        dtype: str = "auto",
        fused: bool = True,
        max_seq_length: int | None = None,
        pooling: str | None = None,
        name: str | None = None,
        **options,
    ) -> tuple[Embedder, LoadReport]:
        """model: "default" (the packaged all-MiniLM-L6-v2), a preset name (random init, default tokenizer),
        or a checkpoint directory (an embedding model, sentence-transformers or plain Hugging Face, a
        `*ForSequenceClassification` classifier / cross-encoder, or a yes/no reranker's `*ForCausalLM`). pooling:
        override an embedding model's pooling (cls, mean, max, mean_sqrt_len_tokens, lasttoken). name: what it is
        called (default: the preset's name, "all-MiniLM-L6-v2", or the directory's name). options: layout, attention,
        cuda_graphs, max_batch_tokens, max_batch, max_graphs, backend, backend_overrides (see __init__)."""
        started = time.perf_counter()
        dev = resolve_device(device)
        resolve_dtype(dtype, dev)  # a wrong name fails before the weights load
        pipeline, classifier, source = None, None, ""
        if model in PRESETS:
            config = EncoderConfig.from_name(model)
            encoder, tokenizer_dir, source = family(config).encoder(config), default_model_dir(), " (random init)"
            name = name or name_of(model)
            if pooling:
                pipeline = Pipeline(read_pipeline(tokenizer_dir, pooling).pooling, source="POOLING setting")
        else:
            path = default_model_dir() if model == "default" else Path(model)
            encoder, rest = load_checkpoint(path)
            tokenizer_dir = path
            name = name or name_of(model)
            classifier = read_classifier(path, encoder.config, rest, encoder.embeddings.word_embeddings)
            if classifier is None:
                pipeline = read_pipeline(path, pooling, family(encoder.config).pooling)
                if pipeline.sparse is not None:
                    hf = json.loads((path / "config.json").read_text())
                    pipeline = dataclasses.replace(pipeline, sparse=masked_lm_tensors(pipeline.sparse, rest,
                                                                                      encoder.config, hf))
                check_encoder_only(rest, encoder.config)
            elif pooling:
                raise UnsupportedModel(f"{name} is a classifier (its head reads the first token): POOLING does not "
                                       "apply")
        if max_seq_length is not None:
            encoder.config = encoder.config.replace(max_seq_length=max_seq_length)
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise CheckpointError(f"{tokenizer_dir} has no tokenizer.json")
        tokenizer = TextTokenizer(tokenizer_dir, encoder.config.max_seq_length)
        dt = resolve_dtype(dtype, dev, family(encoder.config).dtype_on_cuda)
        embedder = cls(encoder, tokenizer, name, dev, dt, pipeline=pipeline, classifier=classifier, **options)
        selection = embedder.set_fused(fused)
        return embedder, LoadReport(name, dev, dt, embedder.config, selection, time.perf_counter() - started,
                                    embedder.describe_head(), source)

    # ---- the path: changed only through these, between forwards ------------------------------------------------
    def set_fused(self, enabled: bool) -> kernels.Selection:
        """Select a backend per op (kernels.select) for the ops this model's forward calls, at its device, dtype and
        width, and use it; enabled=False puts every op on the reference. Clears a fallback. Under CUDA graphs only
        the kernels' device time counts in the race; launched eagerly, host cost counts too. With auto attention on
        a GPU the few-token layer is kept only while its ops run on a fused backend (see _attention_for)."""
        def select(ops) -> kernels.Selection:
            return kernels.select(self.device, (self.dtype,), backend=self.backend, overrides=self.backend_overrides,
                                  fused=enabled, hidden_sizes=(self.config.hidden_size,),
                                  race_timing="device" if self.graphs is not None else "eager", ops=ops)

        attention, _ = self._attention_for(None)
        if self.requested_attention == "auto" and attention == "fused":
            # the few-token ops first, alone (Triton-only: no race; their self-test verdicts are cached for the
            # select below), so a fallback to varlen does not race the other ops twice
            attention, _ = self._attention_for(select(FEW_TOKEN_OPS))
        # may raise: nothing changed
        ops = self.family.kernel_ops(self.layout, attention, self.device, self.dtype) + self.head.ops
        selection = select(ops)
        self.fallback = self.precision_fallback = None
        return self._install(selection)

    def fall_back(self, op: str, reason: str) -> kernels.Selection:
        """Run `op` ("all": every op the model calls) on the torch reference from the next forward on, the same
        way the fused switch does: attention follows (_attention_for), CUDA graphs are re-captured, and the
        selection (so /info and the kernel-timing labels) says so with the reason."""
        ops = list(self.selection.used) if op == "all" else [op]
        self.fallback = reason
        return self._install(self.selection.on_reference(ops, f"fallback: {reason}"))

    def fall_back_precision(self, reason: str) -> bool:
        """PRECISION=fp8's fallback tier: from the next forward on the GEMMs run in the model's dtype (its fp16 fused
        path, the kernels as selected), CUDA graphs re-captured; False where FP8 was not running."""
        if self.active_precision != "fp8":
            return False
        self.precision_fallback = reason
        self._install(self.selection)
        return True

    @property
    def active_precision(self) -> str:
        """"fp8" while the GEMMs run in FP8 (asked for, not fallen back, the fused path on), else "native"."""
        return self.encoder.precision if self.family.fp8 else "native"

    def use(self, selection: kernels.Selection) -> kernels.Selection:
        """Run on `selection` from the next forward on: one derived from this Embedder's own (Selection.on_reference,
        Selection.with_impl: how the tests inject faults)."""
        if selection.device != self.device or self.dtype not in selection.dtypes:
            raise ValueError(f"a selection for {selection.device} {selection.dtypes} cannot run this model "
                             f"({self.device}, {self.dtype})")
        return self._install(selection)

    def _install(self, selection: kernels.Selection) -> kernels.Selection:
        self.selection = selection
        self.attention, self.attention_reason = self._attention_for(selection)
        if self.precision == "fp8":
            on = self.precision_fallback is None and selection.any_fused and self.fallback is None
            self.encoder.precision = "fp8" if on else "native"
        if self.graphs is not None:  # the graphs replay what was captured: a new selection, attention or precision
            self.graphs.attention = self.attention  # drops them
            self.graphs.set_fingerprint((selection.version, self.attention, self.active_precision))
        log.info("kernel selection %d, attention %s (%s)", selection.version, self.attention, self.attention_reason)
        return selection

    def _attention_for(self, selection: kernels.Selection | None) -> tuple[str, str]:
        """The attention mode and why: the one place it is decided. From the requested mode, the device and dtype
        (model.packing.resolve_attention) and, given the ops' selection, auto's few-token layer only while its ops
        are on a fused backend (on the reference they are slower than varlen); None: before any selection."""
        attention = resolve_attention(self.requested_attention, self.device, self.dtype)
        if self.requested_attention != "auto":
            return attention, "as configured" if self.layout == "packed" else "padded layout"
        if attention == "varlen":
            return attention, "auto: one attention per sequence on the CPU"
        if attention != "fused":
            return attention, "auto: varlen attention needs fp16/bf16 on CUDA"
        if not self.family.few_token_layer:
            return "varlen", f"auto: varlen ({self.family.label} layers have no few-token layer)"
        on_reference = [op for op in FEW_TOKEN_OPS
                        if selection is not None and selection.backend_of(op) == REFERENCE_BACKEND]
        if on_reference:
            return "varlen", (f"auto: varlen, since the few-token layer's {', '.join(on_reference)} would run on "
                              f"the reference (slower than varlen)")
        return attention, f"auto: the few-token layer for batches of <= {FUSED_LAYER_TOKENS} tokens, varlen above"

    @contextlib.contextmanager
    def timed(self, callback: Callable[[str, str, float], None]) -> Iterator[None]:
        """Forwards inside the block run eagerly with every op call timed (device events on a GPU, read once after
        the block); callback(op, backend, seconds) gets each call's time, labelled with the backend that ran it."""
        timer = OpTimer(self.device)
        self._observer = timer.call
        try:
            yield
        finally:
            self._observer = None
        for op, backend, seconds in timer.results():
            callback(op, backend, seconds)

    def timed_steps(self, batch: Rows | list[list[int]], callback: Callable[[str, str, float], None]) -> Iterator[None]:
        """`batch`'s eager forward as in timed(), one block per step (the embeddings, each layer, the head: packed
        layout; the whole forward in one step otherwise), each step inside this Embedder's selection and timer, none
        across a yield: the server's worker answers the batches that arrive between two steps on their usual path,
        so they wait for one block's launches at most. callback gets every call's time after the last step. A new
        selection installed between two steps (a backend switch, a fallback) ends the forward there, unreported: the
        path it timed is no longer the one served."""
        timer = OpTimer(self.device)
        selection, attention = self.selection, self.attention
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)

        @contextlib.contextmanager
        def step() -> Iterator[None]:
            with torch.inference_mode(), kernels.use(selection, timer.call):
                yield

        if self.layout != "packed":
            with step():
                self._forward_eager(batch)
        else:
            with step():
                packed = Packed.from_rows(batch, self.device, **self._token_layout())
                blocks = self.encoder.packed_steps(packed, attention)
            while True:
                with step():
                    hidden = next(blocks, None)
                    if hidden is None:
                        break
                    last = hidden
                yield
                if self.selection is not selection:
                    return
            with step():
                self.head(last, packed)
        for op, backend, seconds in timer.results():
            callback(op, backend, seconds)

    def reference_copy(self) -> Embedder:
        """An fp32 copy of this model on the same device, every op on the torch reference, no CUDA graphs: for a
        background thread's checks (the copy is that thread's own; this Embedder stays the worker's)."""
        # the fp8 weights (not parameters) stay behind: the copy runs the reference (memo: what deepcopy gives for them)
        encoder = copy.deepcopy(self.encoder, memo={id(getattr(self.encoder, "fp8_weights", None)): None}).float()
        if hasattr(encoder, "precision"):
            encoder.precision = "native"
        return Embedder(encoder, self.tokenizer, self.name, self.device, torch.float32, pipeline=self.pipeline,
                        classifier=self.classifier, layout=self.layout, cuda_graphs=False)

    def warmup_batches(self) -> list[list[list[int]]]:
        """Token-id batches that make a first forward pay its one-time costs before traffic: the largest batch of
        full-length inputs the batch limits allow, and a single short input."""
        seq = self.config.max_seq_length
        longest = self.tokenizer.encode(["warm up " * seq])[0]  # truncated to seq, special tokens included
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
        seq = self.config.max_seq_length
        longest = self.tokenizer.encode(["warm up " * seq])[0]
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

    @torch.inference_mode()
    def compile_ahead(self, batches: list[list[list[int]]]) -> None:
        """Compile the Triton kernels the eager forwards of `batches` launch, side by side, without running them
        (kernels.compile_only; their outputs are thrown away): the same forwards run next find them compiled."""
        with kernels.use(self.selection), kernels.compile_only():
            for batch in batches:
                self._forward_eager(Rows.of(batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def save_tuning(self) -> None:
        """Keep what the kernels tuned in this process for the next start on this GPU model (kernels.save_tuning):
        after the shape sweep, when every launch shape has been met."""
        kernels.save_tuning(self.device)

    # ---- what it runs on -------------------------------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """The fused path is on and has not fallen back."""
        return self.selection.fused and self.fallback is None

    @property
    def path(self) -> str:
        """"fused" while any op the model calls runs on a fused backend, else "reference"."""
        return "fused" if self.selection.any_fused else "reference"

    def describe(self) -> dict:
        """The model's kernel state for /info and the fused switch's answer."""
        return {
            "kind": self.kind,
            "architecture": self.family.name,
            "dim": self.dim,
            "head": self.describe_head().removeprefix("head: "),
            **({"labels": list(self.classifier.labels)} if self.classifier is not None else {}),
            **({"prompts": dict(self.pipeline.prompts)} if self.pipeline is not None and self.pipeline.prompts else {}),
            "fused": self.fused,
            "fallback": self.fallback,
            "precision": {"requested": self.precision, "active": self.active_precision,
                          "fallback": self.precision_fallback},
            "selection_version": self.selection.version,
            "kernels": self.selection.as_dict()["ops"],
            "layout": self.layout,
            "attention": self.attention,
            "attention_reason": self.attention_reason,
            "cuda_graphs": self.graphs.stats() if self.graphs is not None else {"enabled": False},
            "cuda_launch_configs": self._cuda_launch_configs(),
        }

    def _cuda_launch_configs(self) -> dict:
        """The CUDA backend's tuned launch configurations so far (kernel|dtype|width|row bucket -> config)."""
        if "cuda" not in self.selection.used.values():
            return {}
        return kernels.cuda_launch_configs()

    def report(self) -> str:
        """One line on the forward's shape: layout, attention and why, CUDA graphs (and Triton PDL on a GPU)."""
        if self.graphs is None:
            graphs = "CUDA graphs off"
        else:
            graphs = f"CUDA graphs on (up to {self.graphs.max_graphs} held, {len(self.graphs.graphs)} captured)"
        if self.device.type == "cuda" and "triton" in self.selection.used.values():
            graphs += f", Triton programmatic dependent launch {'on' if kernels.pdl_enabled(self.device) else 'off'}"
        line = f"layout {self.layout}, attention {self.attention} ({self.attention_reason}), {graphs}"
        if self.precision == "fp8":
            which = f"batches above {FUSED_LAYER_TOKENS} tokens" if self.attention == "fused" else "every batch"
            line += (f", FP8 GEMMs for {which} ({self.fp8_bytes / 2**20:.1f} MiB of E4M3 weights)"
                     if self.active_precision == "fp8" else
                     f", FP8 GEMMs off ({self.precision_fallback or 'the fused path is off'})")
        return line

    # ---- forwards ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def embed_ids(self, batch: Rows | list[list[int]], normalize: bool | None = None, *, graphs: bool = True,
                  reference: bool = False) -> Tensor:
        """Pooled embeddings [len(batch), hidden] (float32, on the CPU) for token-id rows of any lengths.
        graphs=False runs the eager forward (the graphs' oracle in tests and benchmarks). reference=True runs this
        one batch eagerly on the torch reference (the worker's re-run of a batch whose fused forward failed); the
        path stays as it is. normalize: None follows the model's pipeline (its Normalize module)."""
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)
        if reference:
            with kernels.use(self._reference):
                pooled = self._forward_eager(batch).cpu() if len(batch) else torch.empty(0, self.dim)
        else:
            pooled = self.launch_ids(batch, graphs=graphs).wait()
        if normalize is None:
            normalize = self.pipeline.normalize if self.pipeline is not None else False
        return torch.from_numpy(l2_normalize(pooled.numpy())) if normalize else pooled

    def capture_graphs(self, progress: Callable[[int, int], None] | None = None, limit: int | None = None) -> int:
        """Capture the reachable CUDA-graph buckets not held yet (model.graphs.CudaGraphs.capture_all), the first
        `limit` in order of need where given, on this selection; returns how many were captured (0 without graphs)."""
        if self.graphs is None:
            return 0
        with kernels.use(self.selection):
            return self.graphs.capture_all(progress, limit)

    def capture_next_graph(self) -> bool:
        """Capture the next reachable bucket not held yet; False when there is none (or no graphs)."""
        if self.graphs is None:
            return False
        with kernels.use(self.selection):
            return self.graphs.capture_next()

    @property
    def graphs_pending(self) -> int:
        """Reachable CUDA-graph buckets not captured yet."""
        return len(self.graphs.pending()) if self.graphs is not None else 0

    @torch.inference_mode()
    def launch_ids(self, batch: Rows | list[list[int]], *, graphs: bool = True) -> Pending:
        """Start the forward of `batch` and return at once where the CUDA-graph path can (the replay and the copy
        of its result to pinned host memory are queued on the stream); `Pending.wait()` gives the unnormalized
        pooled embeddings [len(batch), hidden], float32 on the CPU. The eager paths (no bucket fits, inside
        timed()) compute before returning. The server's worker launches its next batch before it waits for this
        one (server.batcher)."""
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)
        if not len(batch):
            return Pending(torch.empty(0, self.dim))
        with kernels.use(self.selection, self._observer):
            if self.graphs is not None and graphs and self._observer is None:
                pooled = self.graphs.run(batch)  # a view of the graph's output: valid until the bucket's next replay
                if pooled is not None:
                    host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
                    host.copy_(pooled, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                    return Pending(host, done)
            return Pending(self._forward_eager(batch).cpu())

    def _token_layout(self) -> dict:
        return dict(pad_token_id=self.config.pad_token_id, position_offset=self.config.position_offset,
                    pair_types=self.pair_types)

    def _forward_eager(self, rows: Rows) -> Tensor:
        if self.layout == "packed":
            packed = Packed.from_rows(rows, self.device, **self._token_layout())
            return self.head(self.encoder.forward_packed(packed, self.attention), packed)
        batch = rows.tolist()  # the padded layout: the tests' oracle
        seq = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), seq), self.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), seq), dtype=torch.bool)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = True
        types = None
        if self.pair_types:  # the packed layout's token types, padded
            flat, _, _ = Packed.host_buffers(rows, rows.tokens, len(rows), seq, **self._token_layout())
            types = torch.zeros_like(input_ids)
            types[mask] = flat[Packed.FIELDS.index("token_type_ids")]
            types = types.to(self.device)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        return self.head.forward_padded(self.encoder(input_ids, mask, types), mask)

    @torch.inference_mode()
    def embed_tokens(self, batch: Rows | list[list[int]]) -> Tensor:
        """Per-token hidden states of every row, back to back ([tokens, hidden] float32 on the CPU, special tokens
        included; row i is the next batch.lengths[i] of them): the encoder's packed forward on this Embedder's
        selection, eagerly (no graph bucket has per-token output)."""
        batch = batch if isinstance(batch, Rows) else Rows.of(batch)
        with kernels.use(self.selection):
            packed = Packed.from_rows(batch, self.device, **self._token_layout())
            return self.encoder.forward_packed(packed, self.attention)[: batch.tokens].float().cpu()

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
        return self.embed_ids(self.text.texts(texts, TextOptions(truncate=truncate, prompt_name=prompt_name)),
                              normalize)

    def predict(self, pairs: list[tuple[str, str]] | list[str], truncate: bool = True) -> Tensor:
        """A classifier's logits [n, num_labels] float32 for text pairs (or single texts)."""
        if self.kind != "classifier":
            raise ValueError(f"{self.name} is an embedding model, not a classifier")
        inputs = [tuple(p) if not isinstance(p, str) else p for p in pairs]
        return self.embed_ids(self.text.prepare(inputs, TextOptions(truncate=truncate)), normalize=False)

    def describe_head(self) -> str:
        if self.classifier is not None:
            c = self.classifier
            if c.template is not None:
                return (f"head: {self.family.label} yes/no reranker (its prompt template; the LM head's rows "
                        f"{c.template.yes!r} and {c.template.no!r} at the last token), scores through sigmoid")
            return (f"head: {self.family.label} sequence classifier, {len(c.labels)} label(s) {', '.join(c.labels)}, scores "
                    f"through {c.activation}")
        p = self.pipeline
        if p.sparse is not None:
            return (f"head: SPLADE sparse vectors ({p.source}: masked-LM logits, log(1 + {p.sparse.activation}), max "
                    f"over the tokens), dim {self.dim}")
        dense = f", Dense {' -> '.join(str(d.weight.shape[0]) for d in p.dense)}" if p.dense else ""
        prompts = f", prompts {', '.join(p.prompts)}" if p.prompts else ""
        return (f"head: {' + '.join(p.pooling)} pooling ({p.source}){dense}, dim {self.dim}, normalize "
                f"{'on' if p.normalize else 'off'}{prompts}")

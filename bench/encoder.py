"""Encoder suite: our encoder's forward beside the same model in eager PyTorch (Hugging Face transformers'
BertModel, SDPA attention), under torch.compile, and under torch.compile + CUDA graphs (mode="reduce-overhead"),
same config, same token ids, same run. Random-init weights; on a GPU the family's serving dtype (fp16; bf16 for the
decoder embedders), fp32 on the CPU.

Scenarios (one batch shape each, plus a profile):
  minilm-b1-s16          all-MiniLM-L6-v2's shape, one 16-token sequence (a lone request)
  minilm-b32-s128        32 sequences of 128 tokens
  bert-base-b32-s128     BERT-base, 32 x 128
  bert-base-b128-varlen  BERT-base, 128 sequences of 8..128 tokens (seeded): what padding costs the others
  xlm-roberta-base-b32-s128      XLM-RoBERTa-base's shape (250k vocabulary, offset positions), 32 x 128
  mpnet-base-b32-s128, mpnet-base-b128-varlen
                         all-mpnet-base-v2's shape (relative position bias in every layer's attention), beside
                         transformers' MPNetModel
  gte-base-b32-s128, gte-base-b128-varlen
                         gte-multilingual-base's shape (rotary positions, gated GELU), beside transformers' GteModel,
                         or where the installed transformers lacks it, the family's own padded forward in plain
                         torch (model/layers.py GluPostNormEncoder.forward: the same math, SDPA attention)
  nomic-bert-base-b32-s128, nomic-bert-base-b128-varlen
                         nomic-embed-text-v1.5's shape (rotary positions, SwiGLU, no biases), beside transformers'
                         NomicBertModel
  modernbert-base-b32-s128, modernbert-base-b128-varlen
                         ModernBERT-base's shape (22 pre-norm layers, two in three with a 128-token sliding window,
                         GeGLU), beside transformers' ModernBertModel
  deberta-v3-base-b32-s128, deberta-v3-base-b128-varlen
                         deberta-v3-base's shape (disentangled attention: c2p and p2c over 256 log buckets, shared
                         keys), beside transformers' DebertaV2Model
  qwen3-0.6b-b1-s16, qwen3-0.6b-b32-s128, qwen3-0.6b-b128-varlen, qwen3-0.6b-b1-s32768
                         Qwen3-Embedding-0.6B's shape (28 decoder layers, causal grouped-query attention, q/k RMSNorm,
                         SwiGLU) in bfloat16, its serving dtype, beside transformers' Qwen3Model; the 32,768-token input
                         (the model's window, past the batch token budget: eager, alone) reports peak memory (not in
                         the default set; run it with --providers ours: compiling at that length takes minutes)
  cross-encoder-minilm-b32-s128  MiniLM with a one-label classification head (a re-ranker), 32 pairs of 128 tokens,
                                 beside transformers' BertForSequenceClassification
  tiny-b3-varlen, tiny-cross-encoder-b3-varlen
                         the tiny preset, 3 sequences of 4..12 tokens (the CPU tests'; not in the default set)
  fp8-accuracy           PRECISION=fp8 against sentence-transformers in fp32 on a real checkpoint (--model, default
                         the packaged MiniLM), beside our fp16 path: every held-out text's cosine
                         (bench/data/fp8-heldout.txt) and the top-10 neighbours of each of 2,000 texts
                         (bench/data/fp8-corpus.txt: docstrings of Python modules) against the fp32 ones (GPU only)
  profile                where a forward's time goes (torch.profiler: kernel time by category, GPU idle) for
                         --profile-cases, our default path with CUDA graphs and eager (GPU only)

Ours is model.runner.Embedder from token-id rows as the server's batcher hands them over (model.api.Rows, the arrays
the tokenizer writes once per request), as the server runs it: host packing, the copy to the device, the
CUDA-graph replay (or the eager forward), mean pooling and the copy of the result back. "ours" takes the
registry's auto choice per op; "ours triton" / "ours cuda" force one backend. Time: median over rounds of
back-to-back calls (kernels.timing.eager_us: the host's work for one call overlaps the device's for the previous,
as in serving). GEMM floor: the forward's matmul + attention FLOPs on the real tokens at the GEMM rate measured in
the same run (an fp16 8192^3 matmul).
"""

from __future__ import annotations

import argparse
import copy
import gc
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import results as store
from fusedserve.kernels import fp8, timing
from fusedserve.model.api import Rows

# name: (preset, batch, longest sequence, varlen, head: "embedding" (mean pooling) or "classifier" (one label))
CASES = {
    "minilm-b1-s16": ("minilm-l6", 1, 16, False, "embedding"),
    "minilm-b32-s128": ("minilm-l6", 32, 128, False, "embedding"),
    "bert-base-b32-s128": ("bert-base", 32, 128, False, "embedding"),
    "bert-base-b128-varlen": ("bert-base", 128, 128, True, "embedding"),
    "xlm-roberta-base-b32-s128": ("xlm-roberta-base", 32, 128, False, "embedding"),
    "mpnet-base-b32-s128": ("mpnet-base", 32, 128, False, "embedding"),
    "mpnet-base-b128-varlen": ("mpnet-base", 128, 128, True, "embedding"),
    "gte-base-b32-s128": ("gte-base", 32, 128, False, "embedding"),
    "gte-base-b128-varlen": ("gte-base", 128, 128, True, "embedding"),
    "nomic-bert-base-b32-s128": ("nomic-bert-base", 32, 128, False, "embedding"),
    "nomic-bert-base-b128-varlen": ("nomic-bert-base", 128, 128, True, "embedding"),
    "modernbert-base-b32-s128": ("modernbert-base", 32, 128, False, "embedding"),
    "modernbert-base-b128-varlen": ("modernbert-base", 128, 128, True, "embedding"),
    "deberta-v3-base-b32-s128": ("deberta-v3-base", 32, 128, False, "embedding"),
    "deberta-v3-base-b128-varlen": ("deberta-v3-base", 128, 128, True, "embedding"),
    "qwen3-0.6b-b1-s16": ("qwen3-0.6b", 1, 16, False, "embedding"),
    "qwen3-0.6b-b32-s128": ("qwen3-0.6b", 32, 128, False, "embedding"),
    "qwen3-0.6b-b128-varlen": ("qwen3-0.6b", 128, 128, True, "embedding"),
    "qwen3-0.6b-b1-s32768": ("qwen3-0.6b", 1, 32768, False, "embedding"),
    "cross-encoder-minilm-b32-s128": ("minilm-l6", 32, 128, False, "classifier"),
    "tiny-b3-varlen": ("tiny", 3, 12, True, "embedding"),
    "tiny-cross-encoder-b3-varlen": ("tiny", 3, 12, True, "classifier"),
}
SCENARIOS = (*CASES, "profile", "fp8-accuracy")
DEFAULT_SCENARIOS = ("minilm-b1-s16", "minilm-b32-s128", "bert-base-b32-s128", "bert-base-b128-varlen",
                     "xlm-roberta-base-b32-s128", "mpnet-base-b32-s128", "mpnet-base-b128-varlen",
                     "gte-base-b32-s128", "gte-base-b128-varlen", "nomic-bert-base-b32-s128",
                     "nomic-bert-base-b128-varlen", "modernbert-base-b32-s128", "modernbert-base-b128-varlen",
                     "deberta-v3-base-b32-s128", "deberta-v3-base-b128-varlen", "cross-encoder-minilm-b32-s128")
PROVIDERS = ("torch eager", "torch.compile", "torch.compile + CUDA graphs", "ours")
# shapes that are no preset of model/config.py (a family section config lives in its family file): their config.json
HF_SHAPES = {
    "deberta-v3-base": {"model_type": "deberta-v2", "vocab_size": 128100, "hidden_size": 768, "num_hidden_layers": 12,
                        "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
                        "type_vocab_size": 0, "layer_norm_eps": 1e-7, "relative_attention": True,
                        "pos_att_type": ["p2c", "c2p"], "position_buckets": 256, "share_att_key": True,
                        "norm_rel_ebd": "layer_norm", "position_biased_input": False, "max_relative_positions": -1,
                        "hidden_act": "gelu", "pad_token_id": 0},
}


def preset_config(preset: str):
    """A case's EncoderConfig: the preset's, or the family's reading of HF_SHAPES' config.json."""
    from fusedserve.model.config import EncoderConfig
    from fusedserve.model.families import config_from_hf

    return config_from_hf(HF_SHAPES[preset]) if preset in HF_SHAPES else EncoderConfig.from_name(preset)
PROFILE_CASES = ("minilm-b1-s16", "minilm-b32-s128", "bert-base-b32-s128")
# first match wins: attention before GEMM (fmha kernels would match both); rotary's q/k rotation pass is attention's
CATEGORIES = (
    ("attention", r"flash|fmha|attention|efficient_attention|softmax|attn|rotate|rotary"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|linear_gelu|linear_glu|ffn_partials"),
    ("norm", r"layer_norm|layernorm|norm_kernel|_norm"),
    ("activation", r"gelu|erf"),
    ("quantize", r"quantize"),  # PRECISION=fp8's pass of its own over the attention's context (the rest is fused)
    ("elementwise", r"elementwise|vectorized|index|copy|fill|cat|scatter|gather|reduce|arange|compare|segment|mean"),
)


def lengths_for(batch: int, seq: int, varlen: bool, seed: int = 0) -> list[int]:
    if not varlen:
        return [seq] * batch
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(max(4, seq // 16), seq + 1, (batch,), generator=gen).tolist()


def token_rows(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    """[CLS] random ids [SEP] per length (ids past the tokenizer's special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    top = min(vocab_size, 30000)
    return [[101] + torch.randint(1000, top, (n - 2,), generator=gen).tolist() + [102] for n in lengths]


def gemm_flops(config, lengths: list[int]) -> float:
    """Matmul + attention FLOPs of one forward on the real tokens: a gated FFN-in projects to twice the intermediate
    width, a sliding-window layer's query meets at most 2 x window + 1 keys, a causal one the keys up to its own."""
    from fusedserve.model.families import family

    h, inner = config.hidden_size, config.intermediate_size
    ffn = (3 if family(config).gated_ffn else 2) * h * inner
    width = config.num_heads * config.head_dim  # the attention's: queries, context (grouped keys and values: fewer)
    projections = h * (2 * width + 2 * config.kv_heads * config.head_dim)
    linear = 2 * sum(lengths) * (projections + ffn) * config.num_layers
    local = len(config.sliding_layers)
    keys = [min(n, 2 * config.sliding_window + 1) for n in lengths]
    pairs = [n * (n + 1) / 2 if "causal" in family(config).attention else n * n for n in lengths]
    attention = sum(4 * p * width for p in pairs) * (config.num_layers - local) + \
        sum(4 * n * k * width for n, k in zip(lengths, keys)) * local
    return float(linear + attention)


def gemm_tflops(device: str) -> float | None:
    """The GEMM ceiling: an fp16 8192^3 matmul's TFLOP/s (device time), measured in this run; None on the CPU."""
    if not device.startswith("cuda"):
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    us = timing.device_us(lambda: a @ b, calls=5, rounds=10)
    return 2 * 8192**3 / us / 1e6


def _calls_per_round(fn: Callable[[], object], dev: torch.device) -> int:
    """Back-to-back calls making about 20 ms, at least 3."""
    one_ms = timing.eager_us(fn, dev, calls=1, rounds=3, warmup=3) / 1e3
    return max(3, min(200, int(20 / max(one_ms, 1e-3))))


def _rounds(device: str) -> int:
    return 15 if device.startswith("cuda") else 5


def forward_ms(fn: Callable[[], object], device: str) -> float:
    """Median time per call over rounds of back-to-back calls (about 20 ms of calls a round, at least 3 calls)."""
    dev = torch.device(device)
    return timing.eager_us(fn, dev, calls=_calls_per_round(fn, dev), rounds=_rounds(device), warmup=1) / 1e3


def interleaved_ms(fns: dict[str, Callable[[], object]], device: str) -> dict[str, float]:
    """forward_ms for several callables at once: each round times every one (about 20 ms of back-to-back calls),
    in an order reversed every round, and each gets the median of its rounds. A sub-millisecond forward is partly
    host-bound, and timed one after another in one process the same graphs differed by up to a third between
    positions; side by side, a drift in the process falls on all of them alike."""
    dev = torch.device(device)
    calls = {name: _calls_per_round(fn, dev) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(_rounds(device)):
        for name in order if r % 2 == 0 else reversed(order):
            samples[name].append(timing.eager_us(fns[name], dev, calls=calls[name], rounds=1, warmup=1) / 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def hf_model(config, device: str, dtype: torch.dtype, head: str = "embedding"):
    """transformers' model of the same shape: BertModel / XLMRobertaModel / MPNetModel, or
    BertForSequenceClassification."""
    import transformers

    if config.architecture == "gte":
        gte = getattr(transformers, "GteModel", None)
        if gte is None:  # transformers before 5.2x: the family's plain-torch padded forward stands in
            from fusedserve.model.families import family

            return family(config).encoder(config).to(device=device, dtype=dtype).eval()
        shape = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                     num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                     intermediate_size=config.intermediate_size, max_position_embeddings=config.max_position_embeddings,
                     type_vocab_size=config.type_vocab_size, pad_token_id=config.pad_token_id,
                     rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
        model = gte(transformers.GteConfig(**shape, attn_implementation="sdpa"), add_pooling_layer=False)
        return model.to(device=device, dtype=dtype).eval()
    if config.architecture == "nomic_bert":
        nomic = transformers.NomicBertConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, attn_implementation="sdpa")
        return transformers.NomicBertModel(nomic).to(device=device, dtype=dtype).eval()
    if config.architecture == "modernbert":
        modern = transformers.ModernBertConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings, pad_token_id=config.pad_token_id,
            layer_types=["sliding_attention" if i in config.sliding_layers else "full_attention"
                         for i in range(config.num_layers)],
            local_attention=2 * config.sliding_window, global_rope_theta=config.rope_theta,
            local_rope_theta=config.local_rope_theta, attn_implementation="sdpa")
        return transformers.ModernBertModel(modern).to(device=device, dtype=dtype).eval()
    if config.architecture == "qwen3":
        qwen = transformers.Qwen3Config(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
            intermediate_size=config.intermediate_size, max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.layer_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
            attn_implementation="sdpa")
        return transformers.Qwen3Model(qwen).to(device=device, dtype=dtype).eval()
    if config.architecture == "deberta_v2":  # its disentangled attention is transformers' own: no SDPA option
        section = config.section
        deberta = transformers.DebertaV2Config(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings, type_vocab_size=0,
            layer_norm_eps=config.layer_norm_eps, relative_attention=section.relative_attention,
            pos_att_type=list(section.terms), position_buckets=section.buckets, share_att_key=section.share_att_key,
            norm_rel_ebd="layer_norm" if section.norm_rel_ebd else "none",
            position_biased_input=section.position_biased_input, max_relative_positions=-1)
        return transformers.DebertaV2Model(deberta).to(device=device, dtype=dtype).eval()
    if config.architecture == "mpnet":  # its attention is transformers' own (adds the bias): no SDPA option
        mpnet = transformers.MPNetConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                         num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                                         intermediate_size=config.intermediate_size,
                                         max_position_embeddings=config.max_position_embeddings,
                                         layer_norm_eps=config.layer_norm_eps)
        return transformers.MPNetModel(mpnet, add_pooling_layer=False).to(device=device, dtype=dtype).eval()
    shape = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
                 num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
                 max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
                 pad_token_id=config.pad_token_id, attn_implementation="sdpa")
    if config.architecture == "roberta":
        model = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**shape), add_pooling_layer=False)
    elif head == "classifier":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(**shape, num_labels=1))
    else:
        model = transformers.BertModel(transformers.BertConfig(**shape), add_pooling_layer=False)
    return model.to(device=device, dtype=dtype).eval()


def random_classifier(config):
    """A one-label classification head of the architecture's shape, random weights (a cross-encoder's)."""
    from fusedserve.model.families import family
    from fusedserve.model.modules import Classifier

    gen, h = torch.Generator().manual_seed(5), config.hidden_size
    head = family(config).classifier
    names = (head.first, head.second)
    tensors = {f"{names[0]}.weight": torch.randn(h, h, generator=gen) * h**-0.5, f"{names[0]}.bias": torch.zeros(h),
               f"{names[1]}.weight": torch.randn(1, h, generator=gen) * h**-0.5, f"{names[1]}.bias": torch.zeros(1)}
    return Classifier(head, tensors, ("score",), "sigmoid")


def embedder(encoder, device: str, dtype: torch.dtype, *, backend: str, graphs: bool, max_tokens: int,
             max_batch: int, classifier=None, precision: str = "native"):
    """Our serving path for `encoder` (model.runner.Embedder, its kernel selection made for this backend): token ids
    in, so no tokenizer (a preset takes its tokenizer from the packaged model, which a GPU machine may lack)."""
    from fusedserve.model.families import family
    from fusedserve.model.modules import Pipeline
    from fusedserve.model.runner import Embedder

    pipeline = Pipeline(family(encoder.config).pooling)  # the family's (Qwen's: the last token)
    e = Embedder(encoder, None, "bench", torch.device(device), dtype, pipeline=pipeline, classifier=classifier,
                 backend=backend, cuda_graphs=graphs, max_batch_tokens=max_tokens, max_batch=max_batch,
                 precision=precision)
    e.kernel_path.set_fused(True)
    return e


def fp8_runs(config, device: str, backend: str) -> list[tuple[str, str, str]]:
    """The PRECISION=fp8 row, (backend, "graphs", "fp8"), where the family has an FP8 path and the GPU FP8 tensor
    cores; else none."""
    from fusedserve.model.families import family

    if not device.startswith("cuda") or not family(config).fp8 or fp8.unavailable(torch.device(device)) is not None:
        return []
    return [(backend, "graphs", "fp8")]


def encoder_for(encoder, precision: str):
    """The encoder an Embedder of `precision` is built on: the precision is the encoder's state (Encoder.precision),
    so a row of another precision gets its own copy of the shared random init."""
    return encoder if precision == "native" else copy.deepcopy(encoder)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(name: str, args: argparse.Namespace, tflops: float | None, save: Callable[[list[dict], bool], None]
             ) -> list[dict]:
    from fusedserve.model.families import family

    preset, batch, seq, varlen, head = CASES[name]
    config = preset_config(preset)
    device, cuda = args.device, args.device.startswith("cuda")
    dtype = family(config).dtype_on_cuda if cuda else torch.float32
    lengths = lengths_for(batch, seq, varlen)
    rows = token_rows(lengths, config.vocab_size)
    batch_rows = Rows.of(rows)
    longest, tokens = max(lengths), sum(lengths)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    ids, mask = ids.to(device), mask.to(device)
    floor_ms = gemm_flops(config, lengths) / tflops / 1e9 if tflops else None
    out: list[dict] = []
    print(f"{name}: {tokens} real tokens of {batch * longest} padded" +
          (f"; GEMM floor {floor_ms:.3f} ms" if floor_ms else ""), file=sys.stderr, flush=True)

    def record(provider: str, fn: Callable[[], object], **extra) -> None:
        try:
            with torch.inference_mode():
                fn()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                ms = forward_ms(fn, device)
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        except Exception as exc:  # one provider failing (an API missing on this torch, say) is reported, not fatal
            print(f"  {provider}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
            out.append({"provider": provider, **extra, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            save(out, False)
            return
        emit(provider, ms, peak, **extra)

    def emit(provider: str, ms: float, peak: float | None, **extra) -> None:
        label = " ".join([provider, *(f"{k}={v}" for k, v in extra.items() if k in ("backend", "mode", "precision"))])
        out.append({"provider": provider, **extra, "ms": ms, "tokens": tokens, "padded_tokens": batch * longest,
                    "tokens_per_s": tokens / ms * 1e3, "gemm_floor_ms": floor_ms,
                    "pct_floor": 100 * floor_ms / ms if floor_ms else None, "peak_mem_mib": peak})
        print(f"  {label:44s} {ms:8.3f} ms  {tokens / ms * 1e3 / 1e6:7.3f} M tokens/s" +
              (f"  {100 * floor_ms / ms:5.1f}% of the GEMM floor" if floor_ms else ""), file=sys.stderr, flush=True)
        save(out, False)

    providers = [p for p in args.providers if cuda or p != "torch.compile + CUDA graphs"]
    if any(p.startswith("torch") for p in providers):
        from torch import _dynamo as dynamo

        try:
            model = hf_model(config, device, dtype, head)
        except Exception as exc:  # transformers missing or an incompatible version: said, the rest still runs
            print(f"  transformers BertModel unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
            model = None
        if model is not None:
            def call(m):
                return lambda: m(input_ids=ids, attention_mask=mask)

            if "torch eager" in providers:
                record("torch eager", call(model))
            for provider, mode in (("torch.compile", None), ("torch.compile + CUDA graphs", "reduce-overhead")):
                if provider in providers:
                    dynamo.reset()
                    record(provider, call(torch.compile(model, mode=mode)))
            dynamo.reset()
            model = None
            _release()

    if "ours" in providers:
        encoder = family(config).encoder(config)  # one random init, shared by the backends' Embedders
        classifier = random_classifier(config) if head == "classifier" else None
        backends = args.backends or (["auto", "triton", "cuda"] if cuda else ["auto"])
        built: dict[str, tuple[dict, Callable[[], object], float | None]] = {}
        runs = [(backend, mode, "native") for i, backend in enumerate(backends)
                for mode in (["graphs"] if cuda else []) + (["eager"] if i == 0 or not cuda else [])]
        runs += fp8_runs(config, device, backends[0])
        failed: set[str] = set()  # a backend that cannot run here: its other rows are skipped
        for backend, mode, precision in runs:
            if backend in failed:
                continue
            extra = {"backend": backend, "mode": mode, **({"precision": precision} if precision != "native" else {})}
            label = " ".join(["ours", *(f"{k}={v}" for k, v in extra.items())])
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated() if cuda else 0
            try:
                ours = embedder(encoder_for(encoder, precision), device, dtype, backend=backend, graphs=mode == "graphs",
                                max_tokens=max(16384, tokens), max_batch=max(256, batch), classifier=classifier,
                                precision=precision)
                with torch.inference_mode():
                    ours.launch_ids(batch_rows).wait()  # warm: captures the graph, compiles, autotunes
            except Exception as exc:  # a forced backend that cannot run here (no CUDA build, say)
                print(f"  {label}: unavailable ({type(exc).__name__}: {str(exc)[:300]})", file=sys.stderr)
                out.append({"provider": "ours", **extra, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                ours = None
                _release()
                failed.add(backend)
                continue
            # the Embedders stay alive to be timed side by side: each one's peak counts from what was held
            # before it was built (the shared weights, the Embedders built before it)
            peak = (torch.cuda.max_memory_allocated() - held) / 2**20 if cuda else None
            path = ours.kernel_path
            built[label] = ({**extra, "attention": path.attention, "kernels": dict(path.selection.used)},
                            lambda e=ours: e.launch_ids(batch_rows), peak)
            ours = None
        with torch.inference_mode():
            times = interleaved_ms({label: fn for label, (_, fn, _) in built.items()}, device)
        for label, (extra, _, peak) in built.items():
            emit("ours", times[label], peak, **extra)
        built.clear()
        _release()
    save(out, True)
    return out


def category(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    return next((c for c, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


def runtime_calls_us(events, iters: int, top: int = 10) -> dict[str, float]:
    """Host time per forward in each CUDA runtime or driver call of a torch.profiler trace (CPU-side events named
    cuda* / cu*, as CUPTI records them), the largest `top` first: where a forward's host time goes beyond Python.
    Waits (`*Synchronize`) are left out: they are the device's time, not the host's work."""
    totals: dict[str, float] = {}
    for event in events:
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CPU and name.startswith("cu") and "Synchronize" not in name:
            totals[name] = totals.get(name, 0.0) + event.cpu_time_total / iters
    return {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:top]}


def breakdown(fn: Callable[[], object], iters: int = 20) -> dict:
    """Kernel time per forward by category, the GPU's idle time between kernels, the kernel count, the top
    kernels and the CUDA runtime calls' host time (runtime_calls_us; under the profiler, which lengthens each
    call), from a torch.profiler trace of `iters` forwards."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / iters
    totals: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    seen = 0
    events = prof.events()  # built from the trace on each call
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            seen += 1
            totals[category(event.name)] = totals.get(category(event.name), 0.0) + event.device_time / iters
            by_kernel[event.name] = by_kernel.get(event.name, 0.0) + event.device_time / iters
    busy = sum(totals.values())
    return {"wall_us": wall_us, "kernels_per_forward": seen / iters, "gpu_idle_us": max(wall_us - busy, 0.0),
            "kernel_us": {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "top_kernels_us": {k[:120]: round(v, 2) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]},
            "runtime_calls_us": runtime_calls_us(events, iters)}


def host_and_replay_us(ours, rows: Rows, iters: int = 50) -> dict:
    """Where a replayed forward's time goes outside the kernels: host_us, the median host time of one launch_ids
    call on an idle stream (conversion, packing, the input copy and the replay queued; nothing waited for), and
    replay_us, the median device time of the bucket's graph replayed back to back (kernels and the gaps between
    them, no input copy). A back-to-back caller overlaps the two, so a forward costs about the larger."""
    bucket = ours.graphs.bucket(rows)
    graph = ours.graphs.graphs[bucket].graph
    host = []
    for _ in range(iters):
        torch.cuda.synchronize()
        started = time.perf_counter()
        ours.launch_ids(rows)
        host.append((time.perf_counter() - started) * 1e6)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay = []
    for _ in range(iters // 5):
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end) * 1e3 / 5)
    return {"host_us": round(statistics.median(host), 1), "replay_us": round(statistics.median(replay), 1)}


def profile_cases(args: argparse.Namespace, save: Callable[[list[dict], bool], None]) -> None:
    from fusedserve.model.families import family

    if not args.device.startswith("cuda"):
        raise SystemExit("encoder profile: needs a GPU (it reads the kernels' device time from torch.profiler)")
    out: list[dict] = []
    for name in args.profile_cases:
        preset, batch, seq, varlen, _ = CASES[name]
        config = preset_config(preset)
        encoder = family(config).encoder(config)
        dtype = family(config).dtype_on_cuda
        rows = Rows.of(token_rows(lengths_for(batch, seq, varlen), config.vocab_size))
        runs = [("auto", "graphs", "native"), ("auto", "eager", "native"),
                *((b, "graphs", "native") for b in args.backends or () if b != "auto"),
                *fp8_runs(config, args.device, "auto")]
        for backend, mode, precision in runs:
            ours = embedder(encoder_for(encoder, precision), args.device, dtype,
                            backend=backend, graphs=mode == "graphs", max_tokens=16384, max_batch=256,
                            precision=precision)
            with torch.inference_mode():
                result = breakdown(lambda e=ours: e.launch_ids(rows).wait())
                if mode == "graphs":
                    result.update(host_and_replay_us(ours, rows))
            out.append({"provider": "ours", "case": name, "dtype": str(dtype).removeprefix("torch."), "mode": mode,
                        "backend": backend, **({"precision": precision} if precision != "native" else {}),
                        "attention": ours.kernel_path.attention, "kernels": dict(ours.kernel_path.selection.used),
                        "ms": result["wall_us"] / 1e3, **result})
            print(f"{name} {backend} {mode} {precision}: {result['wall_us']:.0f} us/forward, "
                  f"{result['kernels_per_forward']:.0f} kernels, GPU idle {result['gpu_idle_us']:.0f} us, "
                  f"host {result.get('host_us', '-')} us, replay {result.get('replay_us', '-')} us: "
                  f"{result['kernel_us']}; top {result['top_kernels_us']}; host in CUDA calls "
                  f"{result['runtime_calls_us']}", file=sys.stderr, flush=True)
            save(out, False)
            ours = None
            _release()
    save(out, True)


HERE = Path(__file__).resolve().parent
HELDOUT, CORPUS = HERE / "data" / "fp8-heldout.txt", HERE / "data" / "fp8-corpus.txt"
ACCURACY_BATCH = 64  # texts per forward: far past the few-token layer's 64 tokens, so every batch runs FP8
FP8_TARGETS = {"min_cosine": 0.998, "top10_overlap": 0.97}


def _texts(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line]


def top10_overlap(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The mean share of each text's 10 nearest neighbours (cosine, itself left out) in `ours` that are among its 10
    nearest in `reference`; both [n, dim], unit rows."""
    def neighbours(e: torch.Tensor) -> torch.Tensor:
        sims = e @ e.t()
        sims.fill_diagonal_(-2.0)
        return sims.topk(10, dim=1).indices

    a, b = neighbours(ours.double()), neighbours(reference.double())
    return float((a[:, :, None] == b[:, None, :]).any(-1).double().mean())


def fp8_accuracy(args: argparse.Namespace, save: Callable[[list[dict], bool], None], summary: dict) -> None:
    from sentence_transformers import SentenceTransformer

    from fusedserve.model.runner import Embedder
    from fusedserve.model.weights import default_model_dir

    path = args.model or str(default_model_dir())
    held, corpus = _texts(HELDOUT), _texts(CORPUS)
    st = SentenceTransformer(path, device=args.device).float()
    reference = {name: torch.from_numpy(st.encode(texts, batch_size=ACCURACY_BATCH, normalize_embeddings=True,
                                                  convert_to_numpy=True)).double()
                 for name, texts in (("heldout", held), ("corpus", corpus))}
    del st
    _release()
    rows: list[dict] = []
    for precision in ("native", "fp8"):
        ours, _ = Embedder.load(path, device=args.device, dtype="float16", precision=precision)

        def embed(texts: list[str]) -> torch.Tensor:
            out = torch.cat([ours.embed(texts[i: i + ACCURACY_BATCH], normalize=True)
                             for i in range(0, len(texts), ACCURACY_BATCH)]).double()
            return out / out.norm(dim=1, keepdim=True)

        cos = (embed(held) * reference["heldout"]).sum(1)
        started = time.perf_counter()
        corpus_embeddings = embed(corpus)
        ms = (time.perf_counter() - started) * 1e3 / -(-len(corpus) // ACCURACY_BATCH)
        overlap = top10_overlap(corpus_embeddings, reference["corpus"])
        worst = int(cos.argmin())
        # ms: a batch of the corpus, texts to embeddings (tokenizing included), for scale only
        rows.append({"provider": "ours", "precision": precision, "dtype": "float16", "ms": ms,
                     "active_precision": ours.kernel_path.active_precision, "heldout_texts": len(held),
                     "min_cosine": float(cos.min()), "p01_cosine": float(cos.quantile(0.01)),
                     "mean_cosine": float(cos.mean()), "worst_text_words": len(held[worst].split()),
                     "corpus_texts": len(corpus), "top10_overlap": overlap})
        print(f"  {precision}: held-out cosine min {cos.min():.5f} mean {cos.mean():.6f}; top-10 overlap "
              f"{overlap:.4f}", file=sys.stderr, flush=True)
        ours = None
        _release()
        save(rows, False)
    fp8_row = rows[-1]
    summary.update({"fp8_min_cosine": fp8_row["min_cosine"], "fp8_top10_overlap": fp8_row["top10_overlap"],
                    "meets_targets": fp8_row["min_cosine"] >= FP8_TARGETS["min_cosine"]
                    and fp8_row["top10_overlap"] >= FP8_TARGETS["top10_overlap"]})
    save(rows, True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help=f"any of {', '.join(SCENARIOS)} (default: {' '.join(DEFAULT_SCENARIOS)})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                        help="(torch.compile + CUDA graphs runs on a GPU only)")
    parser.add_argument("--backends", nargs="+", choices=("auto", "triton", "cuda", "torch"),
                        help="ours: one row per backend, CUDA graphs; the first also eager (default on a GPU: auto "
                             "triton cuda; on the CPU: auto, eager). profile: auto (graphs and eager) and each other "
                             "backend named here (graphs)")
    parser.add_argument("--profile-cases", nargs="+", choices=list(CASES), default=list(PROFILE_CASES))
    parser.add_argument("--model", help="fp8-accuracy: the checkpoint directory (default: the packaged MiniLM)")
    parser.add_argument("--out", help="the results file (default: bench/results/<gpu>/encoder.json)")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from fusedserve.model.families import family

    out = args.out or store.default_path("encoder", args.device)
    cuda = args.device.startswith("cuda")
    gpu = store.gpu_slug(torch.cuda.get_device_name(torch.device(args.device)) if cuda else None)
    tflops = None
    started = time.monotonic()
    for scenario in args.scenarios or DEFAULT_SCENARIOS:
        head = store.header(args.device, argv)
        if scenario == "profile":
            settings = {"device": args.device, "cases": args.profile_cases, "iters": 20}  # each case in its family's dtype
            summary: dict = {}
        elif scenario == "fp8-accuracy":
            settings = {"device": args.device, "model": args.model or "default", "dtype": "float16",
                        "heldout": str(HELDOUT.relative_to(HERE.parent)), "corpus": str(CORPUS.relative_to(HERE.parent)),
                        "batch": ACCURACY_BATCH, "targets": FP8_TARGETS}
            summary = {}
        else:
            if tflops is None and cuda:
                tflops = gemm_tflops(args.device)
                print(f"GEMM ceiling: {tflops:.0f} TFLOP/s (fp16 8192^3)", file=sys.stderr, flush=True)
            preset, batch, seq, varlen, kind = CASES[scenario]
            dtype = family(preset_config(preset)).dtype_on_cuda if cuda else torch.float32
            settings = {"device": args.device, "dtype": str(dtype).removeprefix("torch."), "preset": preset,
                        "head": kind,
                        "batch": batch, "seq": seq, "varlen": varlen,
                        "lengths": lengths_for(batch, seq, varlen), "providers": args.providers,
                        "backends": args.backends}
            summary = {"gemm_tflops": tflops}

        def save(rows: list[dict], complete: bool, scenario: str = scenario, head: dict = head,
                 settings: dict = settings, summary: dict = summary) -> None:
            store.write(out, "encoder", gpu, scenario, store.block(head, settings, rows, summary, complete=complete))

        if scenario == "profile":
            profile_cases(args, save)
        elif scenario == "fp8-accuracy":
            fp8_accuracy(args, save, summary)
        else:
            run_case(scenario, args, tflops, save)
        print(f"{scenario}: {out} ({time.monotonic() - started:.0f} s into the run)", file=sys.stderr, flush=True)
    return 0

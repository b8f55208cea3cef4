"""Loading a model: the device and dtype it runs in, reading a preset or a checkpoint directory (the encoder's weights,
its tokenizer, what follows the encoder: an embedding pipeline or a classifier), then the kernel selection. The
Embedder it builds (model.runner) runs what is read here; it reads nothing itself."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fusedserve import kernels
from fusedserve.model import describing, host
from fusedserve.model.api import name_of
from fusedserve.model.colbert import read_colbert
from fusedserve.model.config import PRESETS, EncoderConfig, UnsupportedModel
from fusedserve.model.families import family
from fusedserve.model.modules import (Classifier, Pipeline, masked_lm_tensors, read_classifier, read_m3_heads,
                                      read_pipeline)
from fusedserve.model.tokenizer import TextTokenizer
from fusedserve.model.weights import check_encoder_only, default_model_dir, load_checkpoint, read_config

if TYPE_CHECKING:
    from fusedserve.model.runner import Embedder

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    return torch.device(host.place(device))


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


@dataclass
class ReadModel:
    """What a preset or a checkpoint directory holds: the encoder (on the CPU, float32), the directory of its
    tokenizer, and what follows the encoder: an embedding pipeline or a classifier (None: the default pipeline)."""

    encoder: torch.nn.Module
    tokenizer_dir: Path
    name: str
    pipeline: Pipeline | None = None
    classifier: Classifier | None = None
    source: str = ""  # " (random init)" for a preset


def model_config(model: str) -> EncoderConfig:
    """The config of `model` (read_model's), before and without its weights: a preset's, or the checkpoint
    directory's config.json."""
    if model in PRESETS:
        return EncoderConfig.from_name(model)
    return read_config(default_model_dir() if model == "default" else Path(model))


def read_model(model: str, pooling: str | None = None, name: str | None = None,
               max_seq_length: int | None = None, config: EncoderConfig | None = None) -> ReadModel:
    """model: "default" (the packaged all-MiniLM-L6-v2), a preset name (random init, default tokenizer), or a
    checkpoint directory; pooling overrides an embedding model's; name: what it is called (default: name_of(model));
    max_seq_length: the served length, where it is set (a checkpoint's encoder is built for it); config: its
    model_config, where the caller has read it already."""
    name = name or name_of(model)
    config = config or model_config(model)
    if model in PRESETS:
        read = ReadModel(family(config).encoder(config), default_model_dir(), name, source=" (random init)")
        if pooling:
            read.pipeline = Pipeline(read_pipeline(read.tokenizer_dir, pooling).pooling, source="POOLING setting")
        return read
    path = default_model_dir() if model == "default" else Path(model)
    colbert = read_colbert(path)
    if colbert is not None:  # its lengths are the served ones; max_seq_length, where set, is its document_length
        if max_seq_length is not None:
            colbert = dataclasses.replace(colbert, document_length=max_seq_length)
        positions = config.max_position_embeddings - config.position_offset
        if colbert.longest > positions:
            raise UnsupportedModel(f"{name}: ColBERT query_length {colbert.query_length} / document_length "
                                   f"{colbert.document_length} over the encoder's {positions} positions")
        max_seq_length = colbert.longest
    encoder, rest = load_checkpoint(path, config, max_seq_length=max_seq_length)
    for head_tensor in colbert.head_tensors if colbert is not None else ():  # read with the projection
        rest.pop(head_tensor, None)
    read = ReadModel(encoder, path, name)
    read.classifier = read_classifier(path, encoder.config, rest, encoder.embeddings.word_embeddings)
    if read.classifier is not None:
        if pooling:
            raise UnsupportedModel(f"{name} is a classifier (its head reads the first token): POOLING does not apply")
        return read
    read.pipeline = read_pipeline(path, pooling, family(encoder.config).pooling, colbert=colbert)
    if (m3 := read_m3_heads(path, encoder.config.hidden_size)) is not None:
        if read.pipeline.sparse is not None:
            raise UnsupportedModel(f"{name}: a SPLADE head and BGE-M3's heads in one directory")
        read.pipeline = dataclasses.replace(read.pipeline, m3=m3)
    if read.pipeline.sparse is not None:
        hf = json.loads((path / "config.json").read_text())
        read.pipeline = dataclasses.replace(read.pipeline, sparse=masked_lm_tensors(read.pipeline.sparse, rest,
                                                                                    encoder.config, hf))
    check_encoder_only(rest, encoder.config)
    return read


def load(make: type[Embedder], model: str = "default", *, device: str = "auto", dtype: str = "auto",
         fused: bool = True, max_seq_length: int | None = None, pooling: str | None = None, name: str | None = None,
         **options) -> tuple[Embedder, LoadReport]:
    """Embedder.load's body (see there): `make` is the class to build, so this module never imports the runner."""
    started = time.perf_counter()
    dev = resolve_device(device)
    # the family's dtype rules and a wrong name fail before the weights load
    config = model_config(model)
    fam = family(config)
    if dtype in DTYPES:
        fam.check_dtype(DTYPES[dtype])
    dt = resolve_dtype(dtype, dev, fam.dtype_on_cuda)
    read = read_model(model, pooling, name, max_seq_length, config)
    encoder = read.encoder
    if max_seq_length is not None and model in PRESETS:  # a checkpoint's encoder was built for it
        encoder.config = encoder.config.replace(max_seq_length=max_seq_length)
    tokenizer = TextTokenizer(read.tokenizer_dir, encoder.config.max_seq_length)
    embedder = make(encoder, tokenizer, read.name, dev, dt, pipeline=read.pipeline, classifier=read.classifier,
                    **options)
    selection = embedder.kernel_path.set_fused(fused)
    return embedder, LoadReport(read.name, dev, dt, embedder.config, selection, time.perf_counter() - started,
                                describing.head_line(embedder), read.source)

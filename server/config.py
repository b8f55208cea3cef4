"""Service settings: environment variables FUSEDSERVE_*, or the same settings by their names without the prefix
(`max_batch_tokens: 8192`) in a YAML/TOML file given by --config / FUSEDSERVE_CONFIG. Environment wins over the file. Invalid values fail at
startup with a message naming the setting. A setting removed in this release still starts, with a warning that
names it (REMOVED_SETTINGS), so an old config file or manifest keeps working for one release."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import (BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict,
                               TomlConfigSettingsSource, YamlConfigSettingsSource)

from fusedserve.model import api, host
from fusedserve.server.devices import PATTERN as DEVICE_PATTERN

log = logging.getLogger("fusedserve")

# removed setting -> why, for the start-up warning (drop an entry one release after its removal)
REMOVED_SETTINGS = {
    "layout": "the packed layout is the only one served (docs/decisions/0006-padded-layout-not-a-setting.md)",
    "idle_poll_ms": "measured without a client-visible effect (docs/decisions/0003-idle-poll.md)",
    "gil_switch_interval_ms": "no clear or lasting effect measured (docs/decisions/0004-gil-switch-interval.md)",
    "fault_injection": "fault hooks are test-only now (docs/decisions/0005-fault-injection-out-of-the-product.md)",
}


# the choices the model package offers (fusedserve.model.api), not copies of them
Pooling = Literal[api.POOLING_MODES]
Backend = Literal[api.BACKENDS]
# a model's name is a path segment of KServe's /v2/models/{name}/... and an OpenAI model id
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# what a bool setting takes, in any case: pydantic alone would also read yes/no, on/off, y/n, t/f
BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}


class ModelSpec(BaseModel):
    """One entry of `models`: where the model is, and the settings that may differ per model (unset: the
    server-wide setting of the same name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(..., min_length=1, description="'default', a preset, or a checkpoint dir (as `model`)")
    pooling: Pooling | None = None
    max_seq_length: int | None = Field(None, ge=1)


class ModelSettings(BaseSettings):
    """Model and device: which models are served, where, and how their forward runs."""

    model: str = Field("default", description="'default' (packaged all-MiniLM-L6-v2), a preset (tiny, minilm-l6, "
                       "bert-base, xlm-roberta-base, mpnet-base, gte-base, nomic-bert-base, modernbert-base, "
                       "qwen3-0.6b: random weights), or a checkpoint dir: a BERT, RoBERTa / XLM-RoBERTa, DistilBERT, "
                       "MPNet, GTE, NomicBERT, ModernBERT, DeBERTa-v2/v3, Qwen2/Qwen3, Llama/Mistral or "
                       "EmbeddingGemma embedding model, a classifier, or a SPLADE sparse model")
    model_name: str = Field("", description="name clients use in requests and responses (default: derived from model)")
    models: Annotated[dict[str, ModelSpec], NoDecode] = Field(
        default_factory=dict, description="several models in one server, e.g. `minilm=default,reranker=/models/ce`: "
        "each `name=path` (path as `model` takes it) gets its own batcher on the shared device; requests pick one by "
        "name (the `model` field, KServe's path), and without a name go to the first model of the kind their route "
        "serves. Empty: the one `model`, named `model_name`. Not together with `model` / `model_name`",
        json_schema_extra={"values": "`name=path` pairs separated by commas; in a config file a mapping of name to a "
                                     "path or to a table `{path, pooling, max_seq_length}`"})
    model_load_failure: Literal["stop", "skip"] = Field(
        "stop", description="a model that fails to load: `stop` ends the start (exit code 1, the error names the "
        "model); `skip` logs it, reports it failed (start-up report, /readyz, /info) and serves the others, requests "
        "naming it get 503 saying why. The start fails when no model loads")
    device: str = Field("auto", pattern=DEVICE_PATTERN,
                        description="where the models run: `cpu`; `cuda:N`, one GPU; `cuda:0,cuda:1`, those GPUs; "
                        "`cuda`, every visible GPU; `auto`, every visible GPU, else the CPU. With several devices each "
                        "gets `workers` server processes on the one port")
    dtype: Literal[api.DTYPES] = Field(
        "auto", description="compute dtype; `auto`: float32 on the CPU; on CUDA float16, bfloat16 for the decoder "
        "embedders (Qwen2 / Qwen3: their activations overflow float16)")
    fused: bool = Field(True, description="serve on the fused kernels; `false` runs every op on the torch reference "
                        "path")
    precision: Literal[api.PRECISIONS] = Field(
        "native", description="the encoder's GEMMs: `native`, in the dtype; `fp8`, in E4M3 on FP8 tensor cores "
        "(weights per output channel, activations per token; BERT, RoBERTa / XLM-RoBERTa, DistilBERT and MPNet "
        "models, batches past the few-token layer's), the rest in the dtype: on GPUs of compute capability 8.9+ only "
        "(refused elsewhere, naming why). The verifier holds it to `verify_tolerance_fp8`; sustained mismatches move "
        "it back to `native` (docs/operations.md)")
    backend: Backend = Field(
        "auto", description="kernel backend for every op: `auto` self-tests the candidates and, on a GPU, races those "
        "that pass; `cpu` is the CPU's own kernels (aten), `torch` the reference; a forced backend that fails its "
        "self-test stops the start")
    backend_overrides: Annotated[dict[str, Backend], NoDecode] = Field(
        default_factory=dict, description="per-op backend, e.g. 'add_layer_norm=cuda,bias_gelu=triton'")
    max_seq_length: int | None = Field(None, ge=1, description="truncation length (default: the model's); with "
                                       "`models`, every model's unless its entry says otherwise")
    pooling: Pooling | None = Field(
        None, description="an embedding model's pooling, overriding its own (sentence-transformers' 1_Pooling); "
        "a plain Hugging Face directory without it is mean-pooled. With `models`, every model's unless its entry "
        "says otherwise (a classifier refuses it)")
    attention: Literal[api.ATTENTION_MODES] = Field(
        "auto", description="packed attention: varlen (flash over the offsets in fp16/bf16 on CUDA, one SDPA per "
                            "sequence on the CPU), pad-for-SDPA, or fused (batches of <= 64 tokens as four kernels per "
                            "layer, varlen above); auto: fused on CUDA fp16/bf16 while the few-token ops are on a fused "
                            "backend, else varlen (CUDA fp32: pad)", json_schema_extra={"advanced": True})
    cuda_graphs: bool = Field(True, description="replay the packed forward from CUDA graphs per shape bucket (GPU)"
, json_schema_extra={"advanced": True})
    cuda_graph_warmup: bool = Field(True, description="capture every reachable graph bucket ahead of traffic (varlen "
                                    "and fused attention): `cuda_graphs_before_ready` of them before ready, the rest "
                                    "after, while the model is idle; `false`, and pad attention, capture each bucket "
                                    "on first use", json_schema_extra={"advanced": True})
    cuda_graphs_before_ready: int = Field(
        32, ge=0, description="graph buckets captured before ready, in order of need (single requests, shortest first, "
        "then ever larger batches); until the rest are captured a batch without its graph runs eagerly",
        json_schema_extra={"advanced": True})
    cache_dir: str = Field("", description="where compiled and tuned kernels are kept for the next start (Triton's "
                           "cache, the CUDA launch tuning, the backend races; keyed by GPU model, versions and kernel "
                           "sources; replicas may share it). Empty: ~/.cache/fusedserve (the GPU image: /cache)")
    workers: int | Literal["auto"] = Field(
        1, description="server processes per device on one port (a socket each, over which the kernel spreads new "
        "connections), each with its own models (one process is host-bound long before a GPU is busy; run the CUDA "
        "MPS daemon so the kernels of a GPU's workers share it); `auto`: one on the CPU, on a GPU as many as the "
        "host's CPUs (2 each), its free memory and 4 allow, starting the MPS daemon where it can. A worker that "
        "exits is started again; metrics are summed over the workers")
    frontends: int | Literal["auto"] = Field(
        0, description="front-end processes on one port (HTTP, gRPC, tokenizing, answers; no torch, no "
        "weights) in front of one engine process per device that holds the models, their CUDA graphs and the "
        "batches every front-end's requests share (docs/architecture.md); 0: one process does both; `auto`: the "
        "CPUs left after two per GPU engine (on the CPU: one). Not with WORKERS > 1. A front-end or engine that "
        "exits is started again")
    max_cuda_graphs: int = Field(256, ge=1, description="graphs held at once (least recently used evicted)",
                                 json_schema_extra={"advanced": True})
    torch_threads: int = Field(0, ge=0, description="intra-op CPU threads for the model (0: torch's default; with "
                               "WORKERS > 1, the process's CPUs (affinity, cgroup quota) shared out among the "
                               "workers, unless OMP_NUM_THREADS or MKL_NUM_THREADS is set)")

    @field_validator("workers")
    @classmethod
    def _workers(cls, value):
        if isinstance(value, int) and value < 1:
            raise ValueError("workers must be at least 1, or 'auto'")
        return value

    @field_validator("frontends")
    @classmethod
    def _frontends(cls, value):
        if isinstance(value, int) and not 0 <= value <= 64:
            raise ValueError("frontends must be between 0 and 64, or 'auto'")
        return value

    @field_validator("backend_overrides", mode="before")
    @classmethod
    def _parse_overrides(cls, value):
        if isinstance(value, str):
            pairs = [p.strip() for p in value.split(",") if p.strip()]
            try:
                value = dict(p.split("=", 1) for p in pairs)
            except ValueError:
                raise ValueError("expected op=backend pairs separated by commas") from None
            value = {k.strip(): v.strip() for k, v in value.items()}
        return value  # the kernel layer checks the names when the model loads: an unknown op stops the start

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value):
        """`name=path,name2=path2` (the environment), or a mapping of name to a path or a table (a config file)."""
        if isinstance(value, str):
            pairs = [p.strip() for p in value.split(",") if p.strip()]
            parsed: dict[str, str] = {}
            for pair in pairs:
                name, sep, path = pair.partition("=")
                name, path = name.strip(), path.strip()
                if not sep or not name or not path:
                    raise ValueError(f"expected name=path pairs separated by commas, got {pair!r}")
                if name in parsed:
                    raise ValueError(f"model name {name!r} given twice")
                parsed[name] = path
            value = parsed
        if isinstance(value, dict):
            for name in value:
                if not isinstance(name, str) or not MODEL_NAME.match(name):
                    raise ValueError(f"model name {name!r}: use letters, digits, '.', '_' and '-' (at most 128, "
                                     "starting with a letter or digit): it is a URL path segment")
            value = {name: {"path": spec} if isinstance(spec, str) else spec for name, spec in value.items()}
        return value


class BatchingSettings(BaseSettings):
    """Batching and limits: how inputs form batches, and what a request, a connection and a queue may hold."""

    max_batch_tokens: int = Field(
        api.GPU_BATCH_TOKENS, ge=1, description="real tokens per batch (the packed layout runs no padding); unset on a "
        f"CPU device: {api.CPU_BATCH_TOKENS} (a CPU batch's time grows with its tokens, so larger ones gain nothing "
        "and only hold the next request longer)")
    max_batch_requests: int = Field(api.BATCH_INPUTS, ge=1, description="inputs per batch")
    max_wait_ms: float = Field(0.0, ge=0, description="longest an input waits for company before its batch closes "
                               "(0: the worker takes whatever is queued as soon as it is free)")
    overlap_batches: bool = Field(
        True, description="launch the next batch before waiting for the last one's result (CUDA graphs): the GPU "
        "runs while the worker delivers and waits for the GIL", json_schema_extra={"advanced": True})
    max_queue: int = Field(4096, ge=1, description="queued inputs beyond which requests get 429 (each model has its "
                           "own queue and batcher, under the same limits)")
    max_client_batch: int = Field(256, ge=1, description="inputs per request")
    max_request_chars: int = Field(
        512 * 1024, ge=1, description="characters of text per request, all inputs together (413 beyond, before any "
        "is tokenized: the tokenizer's memory grows with the whole text, truncated or not)")
    request_timeout_s: float = Field(30.0, gt=0, description="seconds a request may take from its arrival (its body's "
                                     "read, tokenizing and the queue count): a body not received by then is a 408; "
                                     "inputs still waiting are answered 504 and never run (a batch already running "
                                     "gets `request_grace_s` more); with warm-up on, a request whose forward the "
                                     "warm-up's cost model predicts to outlast it is refused 413 before it runs")
    request_grace_s: float = Field(1.0, ge=0, description="seconds past its deadline a request waits for a batch "
                                   "that holds its inputs and is already running (a forward cannot be stopped once it "
                                   "runs: a batch that ends just past the deadline still answers)",
                                   json_schema_extra={"advanced": True})
    header_timeout_s: float = Field(10.0, gt=0, description="seconds a connection may take to send a request's headers "
                                    "(from connecting, or from the request's first byte); a connection still sending "
                                    "them is closed")
    idle_timeout_s: float = Field(5.0, gt=0, description="seconds a connection with nothing in flight is kept open "
                                  "(HTTP keep-alive between requests; gRPC: a connection without a call, which its "
                                  "client opens again on its next call)")
    max_connections: int = Field(4096, ge=1, description="open connections a worker serves requests on, on each port: "
                                 "past it on HTTP the probes and /metrics are still answered, any other request gets a "
                                 "503 (with Retry-After) and its connection closed, and a new connection has 1 s for "
                                 "its headers; on gRPC a new connection is refused, and calls in flight past it get "
                                 "RESOURCE_EXHAUSTED. Both ports' caps must fit the open files limit (checked at "
                                 "start)")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="request body limit in bytes (413 beyond)")
    max_response_bytes: int = Field(128 * 1024 * 1024, ge=1024, description="per-token answers (/embed_all, "
                                    "multi-vectors on /v1/embeddings): the largest body one may take in its encoding "
                                    "(413 beyond, naming the smaller encodings: base64 takes 44% of float JSON's "
                                    "bytes, base64_float16 22%)")
    grpc_port: int = Field(0, ge=0, le=65535, description="port of the KServe v2 gRPC service (`tritonclient.grpc`; "
                           "texts or token ids in, embeddings out), on the HTTP server's host, under the same keys, "
                           "limits and metrics: max_connections, header_timeout_s for the HTTP/2 handshake, "
                           "idle_timeout_s, request_timeout_s from a call's start (its message's first byte), "
                           "max_body_bytes per message; 0: no gRPC")
    warmup: bool = Field(True, description="before ready: run the model once at every launch shape a batch can meet "
                         "(so no request pays a kernel compile or autotune), capture the first CUDA graphs, "
                         "calibrate the int8 outputs", json_schema_extra={"advanced": True})
    drain_delay_s: float = Field(0.0, ge=0, description="after SIGTERM: report not-ready and refuse new work "
                                 "this long before closing the listener (lets load balancers catch up)")


class VerificationSettings(BaseSettings):
    """Verification and admin: checking the fused outputs against the reference, timing the ops, the admin
    routes."""

    verify_sample_rate: float = Field(0.0, ge=0, le=1, description="share of batches recomputed by the verifier "
                                      "thread on its fp32 reference copy")
    verify_action: Literal["log", "fallback"] = Field(
        "log", description="on a mismatch beyond verify_tolerance: `log`, or `fallback` (every op the model calls "
        "moves to the torch reference, as the admin switch would)")
    verify_tolerance: float = Field(1e-3, gt=0, description="max cosine distance between fused and reference")
    verify_tolerance_fp8: float = Field(2e-2, gt=0, description="the same for batches whose GEMMs ran in FP8 "
                                        "(precision=fp8); 3 mismatches among its last 20 checks move the model to "
                                        "its fp16 fused path (whatever verify_action says), counted in "
                                        "`fusedserve_precision_fallbacks_total`")
    verify_queue: int = Field(8, ge=1, description="sampled batches waiting for the verifier; a full queue drops the "
                              "sample (counted as `dropped`)", json_schema_extra={"advanced": True})
    kernel_timing_sample_rate: float = Field(0.01, ge=0, le=1, description="share of batches whose inputs run "
                                             "again eagerly after they are answered, every op timed "
                                             "(`fusedserve_kernel_duration_seconds`); one sample waits at a time, for "
                                             "an idle moment or at most 1 s")
    admin_token: str = Field("", description="bearer token of the `/admin/*` routes; empty turns them off (404)")


class AccessSettings(BaseSettings):
    """Access and observability: who may call, from which browsers, and how the server reports itself."""

    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="bearer tokens, comma-separated: with any set, every route but the docs, "
        "`/admin/*` (its own token) and the probes needs `Authorization: Bearer <one of them>` (401 otherwise)")
    auth_probes: bool = Field(False, description="with `api_keys` set, require a key on the probes and `/metrics` "
                              "too (`/healthz`, `/readyz`, `/health`, `/v2/health/*`, `/metrics`)")
    cors_allow_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins allowed to call the API from a browser, comma-separated "
        "(`*` for any); empty sends no CORS headers")
    otlp_endpoint: str = Field("", pattern=r"^(https?://\S+)?$",
                               description="OpenTelemetry: an OTLP/HTTP collector (e.g. `http://otel-collector:4318`); "
                               "spans go to `<endpoint>/v1/traces`. Empty turns tracing off")
    otel_service_name: str = Field("fusedserve", min_length=1,
                                   description="`service.name` of the exported spans")
    log_format: Literal["text", "json"] = Field("text", description="`json`: one JSON object per log line, with "
                                                "the request id where there is one")

    @field_validator("api_keys", "cors_allow_origins", mode="before")
    @classmethod
    def _split_list(cls, value):
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        if isinstance(value, (list, tuple)):
            value = [v.strip() if isinstance(v, str) else v for v in value]
            return [v for v in value if v != ""]
        return value


# Every setting, each in its group above; here what checks several groups together and where the values come from (a
# comment, not a docstring: the settings' JSON schema would carry it). Pydantic takes a class's fields from its last
# base first: the groups are listed last to first, so the fields (and docs/configuration.md, generated from them) run
# model, batching, verification, access.
class Settings(AccessSettings, VerificationSettings, BatchingSettings, ModelSettings):
    model_config = SettingsConfigDict(env_prefix="FUSEDSERVE_", extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_removed(cls, data):
        """Removed settings from the file or the environment: a warning each, then ignored."""
        if isinstance(data, dict):
            for key, why in REMOVED_SETTINGS.items():
                given = key in data or f"FUSEDSERVE_{key.upper()}" in os.environ
                data.pop(key, None)
                if given:
                    log.warning("setting %s (FUSEDSERVE_%s) was removed and is ignored: %s; it will be an error in "
                                "the next release", key, key.upper(), why)
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _strict_bool(cls, value, info: ValidationInfo):
        """A bool setting takes true, false, 1 or 0 (any case), as docs/configuration.md lists them: one set of
        spellings everywhere, and a value such as `enabled` or `yes` stops the start naming the setting instead of
        being read one way or the other."""
        if cls.model_fields[info.field_name].annotation is not bool or isinstance(value, bool):
            return value
        word = str(value).strip().lower() if isinstance(value, (str, int)) else None
        if word not in BOOL_WORDS:
            raise ValueError(f"{info.field_name} takes true, false, 1 or 0 (any case), not {value!r}")
        return BOOL_WORDS[word]

    @model_validator(mode="after")
    def _check(self):
        if "max_batch_tokens" not in self.model_fields_set:
            # frozen: set once, here
            object.__setattr__(self, "max_batch_tokens", api.batch_tokens(host.on_gpu(self.device)))
        if self.max_batch_requests > self.max_queue:
            raise ValueError("max_batch_requests must not exceed max_queue")
        if self.models and {"model", "model_name"} & self.model_fields_set:
            raise ValueError("set either models (several models) or model / model_name (one), not both")
        return self

    def served_models(self) -> list[tuple[str | None, ModelSpec]]:
        """(name, spec) of each model to serve, the default first: the `models` setting, or the one `model`
        (named model_name, or None: the name its checkpoint gives)."""
        if self.models:
            return list(self.models.items())
        return [(self.model_name or None, ModelSpec(path=self.model))]

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("FUSEDSERVE_CONFIG")
        if path:
            file = Path(path)
            if not file.is_file():
                raise ValueError(f"FUSEDSERVE_CONFIG: {path} does not exist")
            if file.suffix in (".yaml", ".yml"):
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=file))
            elif file.suffix == ".toml":
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=file))
            else:
                raise ValueError(f"FUSEDSERVE_CONFIG: {path}: use a .yaml, .yml or .toml file")
        return tuple(sources)


"""Encoder benchmark on the GPU: our encoder (each fused backend; padded vs packed; eager vs CUDA graphs) side by
side with Hugging Face transformers' BertModel (eager attention, SDPA, torch.compile, torch.compile with
mode="reduce-overhead", i.e. CUDA graphs), same configs, same token ids, same run. Random-init weights, fp16.

    python -m bench.encoder --out bench/results/$(date +%F)-h200-encoder.json

Time per forward is the median of triton.testing.do_bench (events around each call, so launch overhead and
host work are included). Ours: "packed-graphs" is the serving path from token-id rows (host packing, one H2D
copy, one graph replay, mean pooling included); the eager variants start from device tensors, as HF does.
GEMM floor: the forward's matmul + attention FLOPs on real tokens only, at 716 TFLOP/s dense fp16.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Callable

import torch

from bench import command, save
import kernels
from model.config import EncoderConfig
from model.encoder import OFFSET_ATTENTIONS, Encoder, Packed, mean_pool, packed_mean_pool, resolve_attention
from model.graphs import CudaGraphs

PEAK_FLOPS = 716e12
CASES = {  # name: (preset, batch, seq, varlen)
    "bert-base b32 s128 fixed": ("bert-base", 32, 128, False),
    "bert-base b128 s128 varlen": ("bert-base", 128, 128, True),
    "minilm-l6 b32 s128 fixed": ("minilm-l6", 32, 128, False),
    "minilm-l6 b1 s16": ("minilm-l6", 1, 16, False),
    "bert-base b8 s512 varlen": ("bert-base", 8, 512, True),
}


def lengths_for(batch: int, seq: int, varlen: bool, seed: int = 0) -> list[int]:
    if not varlen:
        return [seq] * batch
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(max(4, seq // 16), seq + 1, (batch,), generator=gen).tolist()


def gemm_floor_ms(cfg: EncoderConfig, lengths: list[int]) -> float:
    h, i = cfg.hidden_size, cfg.intermediate_size
    tokens = sum(lengths)
    linear = 2 * tokens * (4 * h * h + 2 * h * i)
    attention = sum(4 * n * n * h for n in lengths)
    return (linear + attention) * cfg.num_layers / PEAK_FLOPS * 1e3


def timed(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def hf_model(cfg: EncoderConfig, attn: str):
    from transformers import BertConfig, BertModel

    hf_cfg = BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                        num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                        max_position_embeddings=cfg.max_position_embeddings, attn_implementation=attn)
    return BertModel(hf_cfg, add_pooling_layer=False).cuda().half().eval()


def run_hf(name, cfg, ids, mask, record, args) -> None:
    try:
        eager = hf_model(cfg, "eager")
    except Exception as exc:  # transformers missing or an incompatible version: reported, the rest still runs
        print(f"  hf: unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return
    record("hf eager", lambda: eager(input_ids=ids, attention_mask=mask))
    eager = None
    sdpa = hf_model(cfg, "sdpa")
    record("hf sdpa", lambda: sdpa(input_ids=ids, attention_mask=mask))
    if name in args.compile_cases:
        torch._dynamo.reset()
        compiled = torch.compile(sdpa)
        record("hf torch.compile", lambda: compiled(input_ids=ids, attention_mask=mask))
        torch._dynamo.reset()
        graphed = torch.compile(sdpa, mode="reduce-overhead")
        record("hf compile+cudagraphs", lambda: graphed(input_ids=ids, attention_mask=mask))
        torch._dynamo.reset()
        compiled = graphed = None  # noqa: F841
    sdpa = None  # noqa: F841


def run_case(name: str, backends: list[str], args) -> list[dict]:
    preset, batch, seq, varlen = CASES[name]
    cfg = EncoderConfig.from_name(preset)
    lengths = lengths_for(batch, seq, varlen)
    gen = torch.Generator().manual_seed(1)
    rows = [[101] + torch.randint(1000, cfg.vocab_size, (n - 2,), generator=gen).tolist() + [102] for n in lengths]
    longest = max(lengths)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    ids, mask = ids.cuda(), mask.cuda()
    floor = gemm_floor_ms(cfg, lengths)
    out: list[dict] = []

    def record(provider: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            ms = timed(fn)
            peak = torch.cuda.max_memory_allocated()
        except Exception as exc:  # one provider failing (e.g. an API missing on this torch) is reported, not fatal
            print(f"  {provider}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            out.append({"case": name, "provider": provider, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            return
        tokens = sum(lengths)
        out.append({"case": name, "provider": provider, "ms": ms, "tokens": tokens, "padded_tokens": batch * longest,
                    "tokens_per_s": tokens / ms * 1e3, "gemm_floor_ms": floor, "pct_floor": 100 * floor / ms,
                    "peak_mem_mb": peak / 2**20})
        print(f"  {provider:28s} {ms:8.3f} ms  {tokens / ms * 1e3 / 1e6:7.2f} M tok/s  {100 * floor / ms:5.1f}% of "
              f"floor  peak {peak / 2**20:7.0f} MB", file=sys.stderr, flush=True)

    print(f"{name}: {sum(lengths)} real tokens of {batch * longest} padded; GEMM floor {floor:.3f} ms",
          file=sys.stderr, flush=True)
    from kernels.triton._common import pdl_enabled, pdl_launches

    with torch.inference_mode():
        # --- Hugging Face transformers -----------------------------------------------------------
        if "hf" in args.providers:
            run_hf(name, cfg, ids, mask, record, args)

        # --- ours --------------------------------------------------------------------------------
        encoder = Encoder(cfg).cuda().half().eval()
        for backend in backends:
            kernels.configure("cuda", (torch.float16,), backend=backend, hidden_sizes=(cfg.hidden_size,))
            bmask = mask.bool()
            record(f"ours {backend} padded eager", lambda: mean_pool(encoder(ids, bmask), bmask, False))
            packed = Packed.from_rows(rows, "cuda")
            record(f"ours {backend} packed eager",
                   lambda: packed_mean_pool(encoder.forward_packed(packed), packed, False))
            if backend == backends[0]:
                record(f"ours {backend} packed varlen-attn eager",
                       lambda: packed_mean_pool(encoder.forward_packed(packed, "varlen"), packed, False))
            # the serving default (auto: the few-token layer up to 64 tokens + varlen above, where the backend has
            # the few-token ops, else varlen; model.runner.Embedder.configure_kernels), then the others for comparison
            default = resolve_attention("auto", torch.device("cuda"), torch.float16)
            default = "varlen" if default == "fused" and backend != "triton" else default
            attentions = [default]
            attentions += ["varlen"] if default == "fused" else []
            attentions += ["pad"] if backend == backends[0] and default != "pad" else []
            # the Triton backend's few-token layer / one-kernel QKV projection + attention where auto does not take it
            if backend == "triton" and args.fused_attention and "fused" not in attentions:
                attentions.append("fused")
            pdl_on = pdl_enabled()
            variants = [(attention, pdl_on) for attention in attentions]
            if backend == "triton" and args.without_pdl and pdl_on:  # programmatic dependent launch off, to compare
                variants += [(attention, False) for attention in attentions if attention in OFFSET_ATTENTIONS]
            for attention, pdl in variants:
                with pdl_launches(pdl):  # the graphs are captured with it or without; replays keep that
                    graphs = CudaGraphs(encoder, torch.device("cuda"), max_tokens=16384, max_batch=256,
                                        attention=attention)
                    suffix = ("" if attention == default else f" {attention}-attn") + ("" if pdl == pdl_on else
                                                                                        " no-pdl")
                    record(f"ours {backend} packed graphs{suffix}", lambda: graphs.run(rows))
                stats = graphs.stats()
                out[-1]["graphs"] = {k: stats[k] for k in ("graphs", "captures", "eager_fallbacks", "pool_bytes",
                                                           "attention")}
                graphs = None
                torch.cuda.empty_cache()
            if backend == backends[0] and backend != "triton" and args.ffn_epilogue:
                # what-if: this backend for every op but the FFN-in, which runs the Triton GEMM with the bias +
                # GELU epilogue (with the CUDA norms: what auto mode runs when that GEMM wins its race)
                kernels.configure("cuda", (torch.float16,), backend=backend, hidden_sizes=(cfg.hidden_size,),
                                  overrides={"linear_bias_gelu": "triton"})
                graphs = CudaGraphs(encoder, torch.device("cuda"), max_tokens=16384, max_batch=256,
                                    attention=attentions[0])
                record(f"ours {backend} packed graphs + triton FFN-in epilogue", lambda: graphs.run(rows))
                graphs = None
                torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.encoder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--backends", nargs="+", default=["cuda", "triton"])
    parser.add_argument("--providers", nargs="+", default=["hf", "ours"])
    parser.add_argument("--compile-cases", nargs="*", choices=list(CASES), default=list(CASES),
                        help="cases that also run torch.compile (compilation takes ~a minute per case)")
    parser.add_argument("--no-ffn-epilogue", dest="ffn_epilogue", action="store_false",
                        help="skip the what-if row with the Triton GEMM + bias + GELU epilogue as the FFN-in")
    parser.add_argument("--no-fused-attention", dest="fused_attention", action="store_false",
                        help="skip the Triton backend's graphs row with attention=fused (QKV projection + attention as "
                             "one kernel per sequence x head)")
    parser.add_argument("--without-pdl", action="store_true",
                        help="the Triton backend's varlen / fused graphs rows again with programmatic dependent launch "
                             "off (FUSEDSERVE_TRITON_PDL=0; on by default on Hopper)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results = []
    for case in args.cases:
        results += run_case(case, args.backends, args)
        save({"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "command": command("encoder", argv),
              "peak_tflops": PEAK_FLOPS / 1e12, "results": results}, args.out)  # after every case
    print(markdown(results))
    return 0


def markdown(results: list[dict]) -> str:
    cases = list(dict.fromkeys(r["case"] for r in results))
    providers = list(dict.fromkeys(r["provider"] for r in results))
    lines = ["| provider | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    by = {(r["case"], r["provider"]): r for r in results}
    for p in providers:
        cells = []
        for c in cases:
            r = by.get((c, p))
            cells.append("-" if r is None else ("failed" if "error" in r else f"{r['ms']:.3f} ms ({r['pct_floor']:.0f}%)"))
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""What a varlen graph's fixed max_seqlen costs: torch's varlen flash attention on one batch's real lengths, called
with max_seqlen = the batch's longest row (what an eager forward passes) and with the larger bounds a CUDA-graph
bucket fixes at capture (a varlen bucket keeps min(model's longest, tokens), 512 for BERT-base at 9216 tokens).

    python -m bench.varlen_grid --out bench/results/$(date +%F)-h200-varlen-grid.json

Why: at BERT-base b128 s128 varlen the eager varlen forward (4.024 ms) beat the graph replay (4.215) in session 6.
The bucket's 2.5% filler tokens explain part of it; the other suspect is the attention grid, which flash attention
sizes by max_seqlen (query blocks per sequence), so a 512 bound launches four times the query blocks of a 128 one for
128-token rows, the extra ones exiting at once. This measures that alone, per layer call (device time of the call
captured in a CUDA graph, bench.kernels.graph_ms), for each case's lengths and bounds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

import torch

from bench import command, save
from bench.encoder import lengths_for
from bench.kernels import graph_ms
from model.config import EncoderConfig
from model.encoder import _varlen_attention

CASES = {  # name: (preset, batch, seq); the rows get bench.encoder's varlen lengths
    "bert-base b128 s128 varlen": ("bert-base", 128, 128),
    "bert-base b8 s512 varlen": ("bert-base", 8, 512),
    "minilm-l6 b32 s128 varlen": ("minilm-l6", 32, 128),
}
BOUNDS = (128, 256, 512)


def run_case(name: str) -> list[dict]:
    preset, batch, seq = CASES[name]
    cfg = EncoderConfig.from_name(preset)
    lengths = lengths_for(batch, seq, True)
    tokens, longest = sum(lengths), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.float16, generator=gen)
               for _ in range(3))
    cu = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    attn = _varlen_attention()
    out = []
    for bound in sorted({longest, *(b for b in BOUNDS if b >= longest)}):
        us = graph_ms(lambda: attn(q, k, v, cu, cu, bound, bound)) * 1e3
        row = {"case": name, "tokens": tokens, "longest": longest, "max_seqlen": bound, "us_per_call": us,
               "us_per_forward": us * cfg.num_layers}
        out.append(row)
        print(f"{name}: max_seqlen {bound:4d} (longest {longest}): {us:7.1f} us per call, "
              f"{us * cfg.num_layers / 1e3:.3f} ms per {cfg.num_layers}-layer forward", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.varlen_grid", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or _varlen_attention() is None:
        print("bench.varlen_grid needs a CUDA GPU and torch.nn.attention.varlen", file=sys.stderr)
        return 2
    results = []
    with torch.inference_mode():
        for case in args.cases:
            results += run_case(case)
    save({"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "command": command("varlen_grid", argv), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

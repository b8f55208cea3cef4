"""`fusedserve embed "some text" ...`: embed texts with the default model and print JSON lines."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from fusedserve.model.runner import Embedder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusedserve embed", description=__doc__)
    parser.add_argument("texts", nargs="*", help="texts to embed (read from stdin, one per line, if none)")
    parser.add_argument("--model", default="default", help="'default' (packaged all-MiniLM-L6-v2), a preset, or a checkpoint dir")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backend", default="auto", help="auto|triton|cuda|torch")
    parser.add_argument("--no-fused", action="store_true", help="run every op on the torch reference path")
    parser.add_argument("--no-normalize", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    embedder, report = Embedder.load(args.model, device=args.device, dtype=args.dtype,
                                     fused=not args.no_fused, backend=args.backend)
    print(report, file=sys.stderr)
    embeddings = embedder.embed(texts, normalize=False if args.no_normalize else None)
    for text, row in zip(texts, embeddings.tolist()):
        print(json.dumps({"text": text, "dim": len(row), "embedding": [round(v, 6) for v in row]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`fusedserve embed "some text" ...`: embed texts with the default model and print JSON lines."""

from __future__ import annotations

import argparse
import json
import logging
import sys

# Every call loads the model and picks its kernels again; a server does that once.
SERVER_HINT = ("fusedserve embed loads the model on every call: for repeated use, start `fusedserve serve` once and "
               "POST texts to /infer (--quiet prints only the JSON lines)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fusedserve embed", description=__doc__,
        epilog="Each call loads the model; for repeated use, `fusedserve serve` keeps it loaded (POST /infer).")
    parser.add_argument("texts", nargs="*", help="texts to embed (read from stdin, one per line, if none)")
    parser.add_argument("--model", default="default", help="'default' (packaged all-MiniLM-L6-v2), a preset, or a checkpoint dir")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backend", default="auto", help="auto|triton|cuda|torch")
    parser.add_argument("--no-fused", action="store_true", help="run every op on the torch reference path")
    parser.add_argument("--no-normalize", action="store_true")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="print only the JSON lines: no start-up report, hint or warnings on stderr (errors still)")
    args = parser.parse_args(argv)
    # Quiet: stdout is the JSON lines and stderr stays empty unless something fails, so a script can treat any
    # stderr as a problem. Python warnings go through logging, so the one level decides for both.
    logging.basicConfig(level=logging.ERROR if args.quiet else logging.WARNING, format="%(message)s")
    logging.captureWarnings(args.quiet)
    from fusedserve.model.runner import Embedder  # after the logging set-up: torch's import-time warnings obey it

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    embedder, report = Embedder.load(args.model, device=args.device, dtype=args.dtype,
                                     fused=not args.no_fused, backend=args.backend)
    if not args.quiet:
        print(report, file=sys.stderr)
        print(SERVER_HINT, file=sys.stderr)
    embeddings = embedder.embed(texts, normalize=False if args.no_normalize else None)
    for text, row in zip(texts, embeddings.tolist()):
        print(json.dumps({"text": text, "dim": len(row), "embedding": [round(v, 6) for v in row]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

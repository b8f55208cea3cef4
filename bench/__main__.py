"""`python -m bench SUITE [SCENARIO ...] [options]`: run a benchmark suite's scenarios (all by default) and write
their blocks into bench/results/<gpu>/<suite>.json; `python -m bench report` renders the committed results as the
markdown tables and plots of docs/performance.md. `python -m bench SUITE --help` lists a suite's scenarios."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SUITES = {
    "kernels": "each fused op vs eager and torch.compile, per backend, against the copy ceiling",
    "encoder": "the encoder forward vs eager PyTorch, torch.compile and torch.compile + CUDA graphs",
    "serve": "the real server: closed-loop, single, workers, replicas, soak, startup, peer, openai-load",
    "report": "markdown tables (stdout) and PNG plots from the committed results",
}


def main(argv: list[str] | None = None) -> int:
    # torch here rather than at the top: the serving suite's load-generator processes import this module again as
    # their __main__ (multiprocessing's spawn), and they need no torch
    import torch

    argv = sys.argv[1:] if argv is None else argv
    # Without a GPU the kernel and encoder suites run the Triton kernels on the interpreter. Decided before the suites
    # are imported (the kernels read it at import), and not for `serve`: its servers and its in-process runner (the
    # raw rate the servers are held against) choose kernels as deployed, where the interpreter is never on
    if not torch.cuda.is_available() and argv[:1] in (["kernels"], ["encoder"]):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="suite", required=True)
    modules = {}
    for name, help_text in SUITES.items():
        module = importlib.import_module(f"bench.{name}")
        sub = commands.add_parser(name, help=help_text, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        modules[name] = module
    args = parser.parse_args(argv)
    module = modules[args.suite]
    unknown = [s for s in getattr(args, "scenarios", []) if s not in module.SCENARIOS]
    if unknown:
        parser.error(f"{args.suite}: unknown scenario(s) {', '.join(unknown)}; scenarios: "
                     f"{', '.join(module.SCENARIOS)}")
    return module.run(args, argv)


if __name__ == "__main__":
    sys.exit(main())

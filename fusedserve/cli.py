"""The `fusedserve` command: `fusedserve serve` runs the HTTP service, `fusedserve embed TEXT ...` embeds texts in this
process and prints JSON lines. `fusedserve-embed` is kept as an alias of `fusedserve embed`
(docs/decisions/0015-one-namespace.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from fusedserve import __version__


# Each command's own parser (in the module that runs it) reads everything after the command word, so `fusedserve serve
# --help` lists the server's arguments and a new argument needs no change here. The imports are inside the functions
# so that `fusedserve --help` loads neither torch nor the server.
def serve(argv: list[str]) -> int:
    from fusedserve.server.__main__ import main

    return main(argv)


def embed(argv: list[str]) -> int:
    from fusedserve.model.__main__ import main

    return main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "serve": (serve, "run the HTTP service (settings: FUSEDSERVE_* environment variables or --config FILE)"),
    "embed": (embed, "embed texts in this process and print one JSON line per text (--quiet: the lines only); "
                     "for repeated use, `fusedserve serve` keeps the model loaded"),
}


def parser() -> argparse.ArgumentParser:
    """The command word only: the chosen command parses the rest."""
    parser = argparse.ArgumentParser(
        prog="fusedserve", description="Transformer-encoder embeddings and re-ranking on fused GPU kernels.",
        epilog="`fusedserve COMMAND --help` lists a command's arguments.")
    parser.add_argument("--version", action="version", version=f"fusedserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help) in COMMANDS.items():
        commands.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`fusedserve COMMAND [ARGS]`: the first word picks the command, which gets every later word unchanged."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = parser().parse_args(argv[:1]).command
    run, _ = COMMANDS[command]
    return run(argv[1:])


def embed_alias() -> int:
    """`fusedserve-embed ARGS`: the older name of `fusedserve embed ARGS`."""
    return embed(sys.argv[1:])

"""The `fusedserve` command: `fusedserve serve [--host --port --config --log-level]` runs the HTTP service,
`fusedserve embed TEXT ...` embeds texts in-process and prints JSON lines. `fusedserve-embed` is kept as an alias of
`fusedserve embed` (docs/decisions/0015-one-namespace.md)."""

from __future__ import annotations

import sys

COMMANDS = {
    "serve": "run the HTTP service (settings: FUSEDSERVE_* or --config FILE)",
    "embed": "embed texts in this process and print one JSON line per text",
}


def _usage() -> str:
    lines = ["usage: fusedserve COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<7} {help}" for name, help in COMMANDS.items()]
    lines += ["", "`fusedserve COMMAND --help` for a command's arguments"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from fusedserve.server.__main__ import main as serve

        return serve(rest)
    if command == "embed":
        from fusedserve.model.__main__ import main as embed

        return embed(rest)
    print(f"fusedserve: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


def embed_alias() -> int:
    """`fusedserve-embed`: the older name of `fusedserve embed`."""
    from fusedserve.model.__main__ import main as embed

    return embed()

"""python -m fusedserve.kernels.tuning export|where: write kernels/tuning/<gpu>.json from the cache directory's tables for this
GPU model (kernels.cache.export), or print the cache directory."""

from __future__ import annotations

import argparse
import json

from fusedserve.kernels import cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedserve.kernels.tuning", description=__doc__)
    parser.add_argument("command", choices=["export", "where"],
                        help="export: write kernels/tuning/<gpu>.json from the cache directory; where: print the "
                             "cache directory")
    args = parser.parse_args(argv)
    if args.command == "where":
        print(cache.root())
        return 0
    path = cache.export()
    tables = json.loads(path.read_text())["tables"]
    print(f"{path}: " + ", ".join(f"{name} {sum(len(v) for v in entries.values()) if name == 'triton' else len(entries)}"
                                   for name, entries in tables.items()) + " entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""python -m fusedserve.kernels.tuning export|where [--cache-dir DIR]: write kernels/tuning/<gpu>.json from the cache
directory's tables for this GPU model (kernels.cache.export), or print the cache directory."""

from __future__ import annotations

import argparse
import json

from fusedserve.kernels import cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedserve.kernels.tuning", description=__doc__)
    parser.add_argument("command", choices=["export", "where"],
                        help="export: write kernels/tuning/<gpu>.json from the cache directory; where: print the "
                             "cache directory")
    parser.add_argument("--cache-dir", help="the cache directory a server started with (default: FUSEDSERVE_CACHE_DIR, "
                                            "else ~/.cache/fusedserve)")
    args = parser.parse_args(argv)
    cache.configure(args.cache_dir)
    if args.command == "where":
        print(cache.root())
        return 0
    path = cache.export()
    tables = json.loads(path.read_text())["tables"]
    counts = {name: sum(map(len, entries.values())) if name == "triton" else len(entries)
              for name, entries in tables.items()}
    print(f"{path}: " + ", ".join(f"{name} {count}" for name, count in counts.items()) + " entries")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

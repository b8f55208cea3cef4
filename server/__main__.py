"""`python -m server`: start the service with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server", description="fusedserve embedding service. Settings "
                                     "come from FUSEDSERVE_* environment variables or a YAML/TOML file (--config); "
                                     "see README.md for every setting.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", help="YAML or TOML settings file (same keys as FUSEDSERVE_*, lower-case)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.config:
        os.environ["FUSEDSERVE_CONFIG"] = args.config
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn
    from pydantic import ValidationError

    from server.app import create_app
    from server.config import Settings

    try:
        settings = Settings()
    except (ValidationError, ValueError) as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=int(settings.request_timeout_s) + 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())

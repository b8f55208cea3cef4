"""The HTTP service (FastAPI + uvicorn): routes, batching, metrics; it knows a model only through fusedserve.model.api
(and fusedserve.model.host for where models run), and imports no torch."""

if __name__ != "fusedserve.server":  # one module, one name in a process (docs/decisions/0015)
    raise ImportError(f"this package is fusedserve.server, imported here as {__name__!r}: `python -m server` is now "
                      "`fusedserve serve` (or `python -m fusedserve serve`)")


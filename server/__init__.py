"""The HTTP service (FastAPI + uvicorn): routes, batching, metrics; it knows a model only through fusedserve.model.api
(and fusedserve.model.host for where models run), and imports no torch."""

if __name__ != "fusedserve.server":  # the checkout's root on sys.path: an installed `server` is meant
    from fusedserve.shadowing import give_way

    give_way(__name__, __file__, "`python -m server` is now `fusedserve serve` (or `python -m fusedserve serve`)")

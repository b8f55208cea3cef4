"""fusedserve: an embedding and re-ranking service for Transformer encoders on fused GPU kernels.

One import namespace over the repository's three folders: `fusedserve.kernels` (kernels/: the fused ops, importable
on its own), `fusedserve.model` (model/: the architectures and the one seam the server knows them by) and
`fusedserve.server` (server/: HTTP, batching, metrics). The `fusedserve` command is fusedserve.cli."""

# The one place the version is written: pyproject.toml reads it (dynamic) and the server reports it.
__version__ = "0.2.0"

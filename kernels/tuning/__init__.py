"""Shipped tuning: one JSON per GPU model (`<gpu>.json`, named as kernels.cache.gpu_slug names it) with the Triton
configs, CUDA launch configs and backend races a tuned start on that GPU chose; kernels.cache reads it when the cache
directory has no table of its own. `python -m fusedserve.kernels.tuning export` writes it from the cache directory a server
started with (the GPU and switches must be the ones it is shipped for; it records each kernel source's hash, so
that a later edit voids only the entries measured on the edited files)."""

"""Benchmarks: one harness, `python -m bench {kernels,encoder,serve,report}`, each suite a set of named scenarios
whose results go to one JSON file per suite per GPU model (bench/results/<gpu>/<suite>.json, bench.results).

bench runs from the repository's root, where the folders kernels/, model/ and server/ sit beside it; imported by
those bare names (transformers probes for the Hugging Face `kernels` package that way) a folder hands the import to
the installed package of that name (fusedserve.shadowing): the product is imported as fusedserve.* only
(docs/decisions/0015-one-namespace.md)."""

"""Benchmarks: one harness, `python -m bench {kernels,encoder,serve,report}`, each suite a set of named scenarios
whose results go to one JSON file per suite per GPU model (bench/results/<gpu>/<suite>.json, bench.results)."""

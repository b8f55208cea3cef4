"""Benchmarks: one harness, `python -m bench {kernels,encoder,serve,report}`, each suite a set of named scenarios
whose results go to one JSON file per suite per GPU model (bench/results/<gpu>/<suite>.json, bench.results).

bench runs from the repository's root, where the folders kernels/, model/ and server/ sit beside it: a plain
`import kernels` there would load ours under a second name (transformers probes for the Hugging Face `kernels`
package that way). Importing bench hides those three names on the root; the product is imported as fusedserve.*
only (docs/decisions/0015-one-namespace.md). The tests import bench first for the same reason."""

import importlib.machinery
import sys
from pathlib import Path


class _RootFinder(importlib.machinery.FileFinder):
    """The repository root's path entry, finding everything there but kernels/, model/ and server/."""

    HIDDEN = frozenset({"kernels", "model", "server"})

    def find_spec(self, fullname, target=None):
        return None if fullname in self.HIDDEN else super().find_spec(fullname, target)


ROOT = str(Path(__file__).resolve().parent.parent)
sys.path_importer_cache[ROOT] = _RootFinder(
    ROOT, (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
    (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES))

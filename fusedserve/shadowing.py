"""The repository's top folders are the packages fusedserve.kernels, fusedserve.model and fusedserve.server
(docs/decisions/0015-one-namespace.md). Python started in the checkout's root (`python -c`, `python -m`, a REPL) puts
the root first on sys.path, where each folder would shadow an installed top-level package of the same name:
Hugging Face's `kernels` above all, which transformers imports. Imported by its bare name, a folder hands the import
over to the package that name means everywhere else, so `import sentence_transformers` works in the checkout."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def give_way(name: str, init_file: str, hint: str = "") -> None:
    """Called by a folder's __init__ imported as `name` (not as fusedserve.<name>): the module of that name found on
    sys.path without the checkout's root takes this one's place in sys.modules, which is what the import statement
    returns. None found: ModuleNotFoundError, as if the folder were not there (`hint` says what was meant)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the checkout's {name}/ folder is fusedserve.{name}"
                                  f"{': ' + hint if hint else ''})", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise

"""The one directory for what choosing kernels computes once and every later start reuses: Triton's compiled kernels
and autotune results (`triton/`), the CUDA launch-configuration table (`tuning-<gpu>.json`), the backend races'
timings (`races-<gpu>.json`) and, unless FUSEDSERVE_CUDA_CACHE names a prebuilt one, the CUDA extension (`cuda/`).

FUSEDSERVE_CACHE_DIR sets it (the service's CACHE_DIR setting exports it; default ~/.cache/fusedserve). A file is
named by what its entries depend on: the GPU model and a hash of the torch/Triton/CUDA versions and the kernels'
sources (`fingerprint()`), so a new GPU, a new release or an edited kernel starts a new file instead of reusing
(Triton keys its own cache the same way). Replicas on one node may share it: files are written to a per-process
temporary file and renamed into place, so a reader sees a whole file or none, and a file that cannot be read is
reported once and rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("fusedserve.kernels")

ENV = "FUSEDSERVE_CACHE_DIR"
_SOURCES = (".py", ".cu", ".cuh", ".h", ".cpp")


def root() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "fusedserve")


def use_for_triton() -> None:
    """Triton's compiled kernels and autotune results under root()/triton, unless TRITON_CACHE_DIR says otherwise.
    Called before the Triton backend compiles anything (Triton reads the variable when it opens its cache)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(root() / "triton"))


@functools.cache
def fingerprint() -> str:
    """The versions, the kernel layer's switches (autotune, PDL, CUDA tuning) and the kernel sources a cached decision
    depends on, as one short hash."""
    digest = hashlib.sha256()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # the reference and CUDA backends run without it
        triton_version = ""
    # the kernel layer's own switches change what a tuned choice or a race measured
    switches = [os.environ.get(name, "") for name in ("FUSEDSERVE_TRITON_AUTOTUNE", "FUSEDSERVE_TRITON_PDL",
                                                      "FUSEDSERVE_CUDA_TUNE")]
    for part in (torch.__version__, str(torch.version.cuda), triton_version, *switches):
        digest.update(part.encode())
    package = Path(__file__).parent
    for path in sorted(p for p in package.rglob("*") if p.suffix in _SOURCES):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def gpu_file(prefix: str, device: torch.device | None = None) -> Path:
    """root()/<prefix>-<gpu model>-<fingerprint>.json for the given (default: current) CUDA device."""
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device)).strip("-").lower()
    return root() / f"{prefix}-{gpu}-{fingerprint()}.json"


def read_table(path: Path, valid: Callable[[object], bool], what: str) -> dict:
    """The JSON object in `path`: empty when missing; reported and empty when unreadable or not `valid`."""
    try:
        table = json.loads(path.read_text())
        if not valid(table):
            raise ValueError("unexpected content")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        log.warning("%s %s is unreadable (%s: %s); starting from an empty table, the next save overwrites it",
                    what, path, type(exc).__name__, exc)
        return {}
    return table


def write_table(path: Path, table: dict) -> OSError | None:
    """Atomically replace `path` with `table` (a per-process temporary file renamed into place). The error when the
    directory is not writable (the caller says so once), else None."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return exc
    return None

"""Build (or find already built) the CUDA extension: torch.utils.cpp_extension.load over csrc/, into a
persistent cache so only the first start of a given source tree + torch + GPU architecture pays for nvcc.

    python -m fusedserve.kernels.cuda.build            # pre-build (the GPU image does this at docker build time)
    FUSEDSERVE_CUDA_CACHE=/path ...         # build directory (default: cuda/ in kernels.cache.root())
    TORCH_CUDA_ARCH_LIST="9.0"              # target GPUs when building without one (default: the visible GPU)

The cache key is a hash of the sources, the torch and CUDA versions and the architecture list, so an edited
kernel or an upgraded torch builds afresh in its own directory instead of loading a stale library.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import filelock
import torch

from fusedserve.kernels.cuda.errors import BuildUnavailable

log = logging.getLogger("fusedserve.kernels.cuda")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "norm.cu", "pointwise.cu", "segment.cu")
NAME = "fusedserve_cuda"
# the C++ standard is torch's choice (C++17 for torch 2.11, C++20 for 2.14): not set here
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

_loaded: Path | None = None


def cache_root() -> Path:
    """FUSEDSERVE_CUDA_CACHE (the GPU image's prebuilt extension), else the cache directory's cuda/."""
    from fusedserve.kernels import cache

    return Path(os.environ.get("FUSEDSERVE_CUDA_CACHE") or cache.root() / "cuda")


def cuda_home() -> Path | None:
    """The CUDA toolkit: CUDA_HOME, else the one behind nvcc on PATH, else /usr/local/cuda; a candidate counts
    only if it has bin/nvcc and include/cuda_runtime.h (a wrapper script in /usr/local/bin would otherwise make
    torch guess CUDA_HOME=/usr/local and miss the headers)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if shutil.which("nvcc"):
        candidates.append(str(Path(shutil.which("nvcc")).resolve().parents[1]))
    candidates.append("/usr/local/cuda")
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda_runtime.h").exists():
            return Path(home)
    return None


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the visible GPU's compute capability (9.0 for an H100/H200)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


def build_dir() -> Path:
    digest = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp")):
        digest.update(name.encode() + (CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{arch_list()}|{CUDA_FLAGS}".encode())
    return cache_root() / f"{NAME}-{digest.hexdigest()[:16]}"


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


def load(verbose: bool = False) -> Path:
    """Load the library (registers torch.ops.fusedserve_cuda.*), building it first if the cache lacks it;
    returns its directory. A cached build is loaded directly, without nvcc or ninja and without writing to
    the cache (the GPU image ships it pre-built in a read-only layer)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if torch.version.cuda is None:
        raise BuildUnavailable("this torch build has no CUDA support")
    directory = build_dir()
    if library_path().is_file():
        _load_cached(directory)
        _loaded = directory
        return directory
    home = cuda_home()
    if home is None:
        raise BuildUnavailable("nvcc not found and no pre-built extension in the cache (set CUDA_HOME or put nvcc "
                               "on PATH; the GPU image pre-builds it with `python -m fusedserve.kernels.cuda.build`)")
    # torch.utils.cpp_extension reads CUDA_HOME when first imported
    os.environ["CUDA_HOME"] = str(home)
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise BuildUnavailable("building needs ninja (pip install ninja)")
    # Replicas sharing the cache build once: the first takes the lock and builds, the others wait and then load its
    # library. The build goes to a directory of this process's own, renamed into place when complete, so the
    # lock-free check above never finds a library the linker is still writing.
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(f"{directory}.lock", timeout=900):
            if library_path().is_file():  # another replica built it while this one waited
                _load_cached(directory)
            else:
                _build(cpp_extension, directory, verbose)
    except (OSError, filelock.Timeout) as exc:
        raise BuildUnavailable(f"cannot build into the cache {directory.parent} ({type(exc).__name__}: {exc})"
                               ) from exc
    _loaded = directory
    return directory


def _load_cached(directory: Path) -> None:
    started = time.perf_counter()
    torch.ops.load_library(str(library_path()))
    log.info("CUDA extension loaded from cache in %.1fs (%s)", time.perf_counter() - started, directory)


def _build(cpp_extension, directory: Path, verbose: bool) -> None:
    """nvcc over csrc/ into `directory`, through a temporary directory beside it (the build also loads the library
    into this process)."""
    staging = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    log.warning("building the CUDA extension into %s (first start for these sources; about a minute)...",
                directory)
    started = time.perf_counter()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch_list())
    try:
        cpp_extension.load(
            name=NAME, sources=[str(CSRC / s) for s in SOURCES], build_directory=str(staging),
            extra_cflags=["-O3"], extra_cuda_cflags=CUDA_FLAGS, extra_include_paths=[str(CSRC)],
            is_python_module=False, verbose=verbose)
    except Exception as exc:  # a compiler error is long: keep its tail, which names the failing line
        shutil.rmtree(staging, ignore_errors=True)
        raise BuildUnavailable(f"building the extension failed: {str(exc)[-2000:]}") from exc
    shutil.rmtree(directory, ignore_errors=True)  # an interrupted build's leftovers (no library: checked above)
    staging.rename(directory)
    log.info("CUDA extension built in %.1fs (%s)", time.perf_counter() - started, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedserve.kernels.cuda.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"arch list {arch_list()}; cache {cache_root()}", flush=True)
        directory = load(verbose=args.verbose)
    except BuildUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ops = [name for name in ("norm", "embedding_norm", "bias_act") if hasattr(torch.ops.fusedserve_cuda, name)]
    print(f"ok: {directory} (torch.ops.fusedserve_cuda: {', '.join(ops)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one directory for what choosing kernels computes once and every later start reuses: Triton's compiled kernels
and autotune results (`triton/`), the CUDA launch-configuration table (`tuning-<gpu>.json`), the backend races'
timings (`races-<gpu>.json`) and, unless FUSEDSERVE_CUDA_CACHE names a prebuilt one, the CUDA extension (`cuda/`).

kernels.configure(cache_dir=...) sets it (the model layer passes the service's cache_dir setting); unconfigured, as in
standalone use (benchmarks, the tuning export), it is FUSEDSERVE_CACHE_DIR, else ~/.cache/fusedserve. A file is
named by what its entries depend on: the GPU model and a hash of the torch/Triton/CUDA versions and the kernels'
sources (`fingerprint()`), so a new GPU, a new release or an edited kernel starts a new file instead of reusing
(Triton keys its own cache the same way). Replicas on one node may share it: files are written to a per-process
temporary file and renamed into place, so a reader sees a whole file or none, and a file that cannot be read is
reported once and rebuilt.

Shipped tuning: `kernels/tuning/<gpu>.json` holds the same tables for a GPU model, exported from a tuned start on
that GPU (`python -m fusedserve.kernels.tuning export`). A start whose own table is missing begins from the shipped
one, so a fresh machine compiles only the chosen configurations and races nothing it shipped with. It is used only
with the switches it was made with, and entry by entry only where the source files the entry was measured on (its
kernel's module and what that imports, the shared row buckets, op specs and race) are unchanged: the file records the
hash of each, so a kernel added or edited since the export leaves the other kernels' entries in use. Its Triton
configs only on the same Triton minor release (a config that fits one release's shared memory may not fit
another's), and only those that are still candidates. The self-tests still run on fresh inputs at every start.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import filelock
import torch

log = logging.getLogger("fusedserve.kernels")

ENV = "FUSEDSERVE_CACHE_DIR"  # the fallback where nothing configured the directory (standalone use)
TRITON_ENV = "TRITON_CACHE_DIR"
_SOURCES = (".py", ".cu", ".cuh", ".h", ".cpp")

_configured: Path | None = None  # set by configure(); None: ENV, else the default
_triton_dir: str | None = None  # the TRITON_CACHE_DIR use_for_triton set, to tell it from one the user set


def configure(directory: str | os.PathLike | None) -> None:
    """The cache directory from now on; None (or empty) goes back to FUSEDSERVE_CACHE_DIR, else the default. Where
    use_for_triton already pointed Triton's cache into the previous directory, Triton's cache follows (one the user
    set in TRITON_CACHE_DIR is left alone)."""
    global _configured
    _configured = Path(directory) if directory else None
    if _triton_dir is not None and os.environ.get(TRITON_ENV) == _triton_dir:
        _point_triton()


def root() -> Path:
    if _configured is not None:
        return _configured
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "fusedserve")


def use_for_triton() -> None:
    """Triton's compiled kernels and autotune results under root()/triton, unless TRITON_CACHE_DIR says otherwise.
    Called before the Triton backend compiles anything (Triton reads the variable each time it opens its cache)."""
    if TRITON_ENV not in os.environ:
        _point_triton()


def _point_triton() -> None:
    global _triton_dir
    _triton_dir = os.environ[TRITON_ENV] = str(root() / "triton")


# the kernel layer's own switches: each changes what a tuned choice or a race measured
SWITCHES = ("FUSEDSERVE_TRITON_AUTOTUNE", "FUSEDSERVE_TRITON_PDL", "FUSEDSERVE_CUDA_TUNE")
SHIPPED = Path(__file__).parent / "tuning"
TABLES = ("triton", "tuning", "races")  # Triton's chosen configs, the CUDA launch configs, the backend races


def switches() -> dict[str, bool]:
    return {name: os.environ.get(name, "1") != "0" for name in SWITCHES}


# What decides what is compiled, tuned and raced: the kernels of both backends, the row buckets, the op specs (the
# races' inputs), the race and its timer. Not the dispatch layer, this cache or the references: editing those keeps
# every tuned choice (and the shipped tuning) valid.
_TUNED_SOURCES = ("triton", "cuda", "_layout.py", "spec.py", "registry.py", "timing.py")
# Of those, what every tuned choice depends on; each also depends on its own kernels (_depends_on).
_SHARED_SOURCES = ("_layout.py", "spec.py", "registry.py", "timing.py")


@functools.cache
def _hashed_sources() -> tuple[str, dict[str, str]]:
    """One read of the tuned sources (_TUNED_SOURCES: their .py/.cu/.cuh/.h/.cpp): a short hash of them all, and one
    of each file by its path under the kernels package."""
    package = Path(__file__).parent
    digest, files = hashlib.sha256(), {}
    for path in sorted(p for name in _TUNED_SOURCES for p in [package / name, *(package / name).rglob("*")]
                       if p.is_file() and p.suffix in _SOURCES):
        name, data = path.relative_to(package).as_posix(), path.read_bytes()
        digest.update(name.encode())
        digest.update(data)
        files[name] = hashlib.sha256(data).hexdigest()[:16]
    return digest.hexdigest()[:16], files


def sources_hash() -> str:
    """A short hash of the kernel sources a tuned choice depends on: what names the cache files (fingerprint())."""
    return _hashed_sources()[0]


def source_hashes() -> dict[str, str]:
    """{path under the kernels package: short hash of its bytes} for each file sources_hash covers. A shipped file
    records them, so that an edit voids only the shipped entries that depend on the edited files."""
    return _hashed_sources()[1]


@functools.cache
def _imports(source: str) -> frozenset[str]:
    """The tuned source files `source` (a path under the kernels package) needs, itself included, following its
    imports of fusedserve.kernels modules."""
    package = Path(__file__).parent
    files = set(source_hashes())
    needed, todo = set(), [source]
    while todo:
        name = todo.pop()
        if name in needed or name not in files or not name.endswith(".py"):
            continue
        needed.add(name)
        for node in ast.walk(ast.parse((package / name).read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                if module.startswith("fusedserve.kernels."):
                    parts = module.removeprefix("fusedserve.kernels.").replace(".", "/")
                    todo += [f"{parts}.py", f"{parts}/__init__.py"]
    return frozenset(needed)


@functools.cache
def _kernel_sources() -> dict[str, str]:
    """{Triton kernel function name: the file defining it} (the Triton table's keys are kernel names)."""
    package = Path(__file__).parent
    defined = {}
    for name in source_hashes():
        if name.startswith("triton/") and name.endswith(".py"):
            for node in ast.parse((package / name).read_text()).body:
                if isinstance(node, ast.FunctionDef):
                    defined.setdefault(node.name, name)
    return defined


def _depends_on(prefix: str, key: str) -> frozenset[str] | None:
    """The tuned source files the shipped entry `key` of table `prefix` was measured on; None where that is not
    known (an entry of another layout, which is then not taken)."""
    from fusedserve.kernels.spec import launcher_modules

    cuda = frozenset(name for name in source_hashes() if name.startswith("cuda/"))
    if prefix == "tuning":  # the CUDA launch configurations: the whole extension
        files = cuda
    elif prefix == "triton":
        if key not in _kernel_sources():
            return None
        files = _imports(_kernel_sources()[key])
    elif prefix == "races":  # op|dtype|rows|cols|backends|timing: the launchers of the op in each raced backend
        parts = key.split("|")
        if len(parts) != 6:
            return None
        files = frozenset()
        for backend in parts[4].split(","):
            if backend == "cuda":
                files |= cuda
            elif backend == "triton" and (module := launcher_modules("triton").get(parts[0])):
                files |= _imports(f"triton/{module}.py")
            else:
                return None
    else:
        return None
    return files | frozenset(_SHARED_SOURCES)


@functools.cache
def fingerprint() -> str:
    """The versions, the kernel layer's switches (autotune, PDL, CUDA tuning) and the kernel sources a cached decision
    depends on, as one short hash."""
    digest = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), _triton_version(),
                 json.dumps(switches(), sort_keys=True), sources_hash()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def gpu_name(device: torch.device | None = None) -> str:
    return torch.cuda.get_device_name(device)


def gpu_slug(device: torch.device | None = None) -> str:
    """The GPU model as a file name part: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu_name(device)).strip("-").lower()


def gpu_file(prefix: str, device: torch.device | None = None) -> Path:
    """root()/<prefix>-<gpu model>-<fingerprint>.json for the given (default: current) CUDA device."""
    return root() / f"{prefix}-{gpu_slug(device)}-{fingerprint()}.json"


_shipped_said: set[str | tuple[Path, tuple[int, int]]] = set()  # what shipped() said already


@functools.cache
def _read_shipped(path: Path, stamp: tuple[int, int]) -> dict:
    """The parsed shipped file, once per version of it on disk (`stamp`: mtime and size)."""
    return read_table(path, lambda t: isinstance(t, dict) and isinstance(t.get("tables"), dict), "shipped tuning")


def _changed_sources(table: dict) -> set[str] | None:
    """The tuned source files that differ from those the shipped `table` was made from (edited, added or removed);
    None when the table does not say file by file."""
    if table.get("sources") == sources_hash():
        return set()
    made_from = table.get("source_files")
    if not isinstance(made_from, dict):
        return None
    now = source_hashes()
    return {name for name in {*made_from, *now} if made_from.get(name) != now.get(name)}


def _unchanged(prefix: str, entries: dict, changed: set[str]) -> dict:
    """The entries of shipped table `prefix` measured on none of the `changed` files."""
    return {key: entry for key, entry in entries.items()
            if (files := _depends_on(prefix, key)) is not None and not files & changed}


def shipped(prefix: str, device: torch.device | None = None) -> dict:
    """The shipped table `prefix` (one of TABLES) for this GPU model: empty when none ships for it or it was made with
    other switches; of a file made from other kernel sources, the entries that do not depend on the changed files
    (what was left out is said once); the Triton table also only on the Triton minor release that chose it (a config
    that fits one release's shared-memory layout may not fit another's)."""
    gpu = gpu_slug(device)
    path = SHIPPED / f"{gpu}.json"
    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    stamp = (stat.st_mtime_ns, stat.st_size)
    table = _read_shipped(path, stamp)
    if not table:
        return {}
    changed = _changed_sources(table)
    if table.get("switches") != switches() or changed is None:
        if gpu not in _shipped_said:
            _shipped_said.add(gpu)
            log.warning("shipped tuning %s was made from other kernel sources or switches; this start tunes "
                        "and races on the machine", path)
        return {}
    made_with = table.get("made_with") if isinstance(table.get("made_with"), dict) else {}
    if prefix == "triton" and _minor(_triton_version()) != _minor(str(made_with.get("triton", ""))):
        return {}
    tables = {name: entries for name, entries in table["tables"].items() if isinstance(entries, dict)}
    if changed:
        kept = {name: _unchanged(name, entries, changed) for name, entries in tables.items()}
        dropped = {name: len(tables[name]) - len(entries) for name, entries in kept.items()}
        if sum(dropped.values()) and (path, stamp) not in _shipped_said:
            _shipped_said.add((path, stamp))
            log.warning("shipped tuning %s was made before edits to %s: this start tunes and races again the entries "
                        "measured on them (%s); it takes the rest", path, ", ".join(sorted(changed)),
                        ", ".join(f"{n} of {len(tables[name])} {name}" for name, n in dropped.items() if n))
        tables = kept
    return tables.get(prefix, {})


def export(device: torch.device | None = None) -> Path:
    """Write SHIPPED/<gpu>.json from this cache directory's tables for the current GPU model, versions and
    sources (what a tuned start left there), over the entries of the shipped file that still apply (a start saves
    only what it tuned itself: what it took from the shipped file stays in the shipped file)."""
    local = {prefix: read_table(gpu_file(prefix, device), lambda t: isinstance(t, dict), prefix) for prefix in TABLES}
    tables = {prefix: {**shipped(prefix, device), **local[prefix]} for prefix in TABLES}
    if not any(local.values()):
        raise SystemExit(f"nothing to export: no {'/'.join(TABLES)} table for {gpu_slug(device)} and fingerprint "
                         f"{fingerprint()} in {root()} (start a server with this cache directory first)")
    path = SHIPPED / f"{gpu_slug(device)}.json"
    shipped_table = {"gpu": gpu_name(device), "sources": sources_hash(), "source_files": source_hashes(),
                     "switches": switches(),
                     "made_with": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": _triton_version()},
                     "tables": tables}
    error = write_table(path, shipped_table)
    if error is not None:
        raise SystemExit(f"cannot write {path}: {error}")
    return path


_reported: set[tuple[str, int, int]] = set()  # (path, mtime, size) of the unreadable tables said so already


def read_table(path: Path, valid: Callable[[object], bool], what: str) -> dict:
    """The JSON object in `path`: empty when missing; reported and empty when unreadable or not `valid`."""
    try:
        table = json.loads(path.read_text())
        if not valid(table):
            raise ValueError("unexpected content")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        # said once per file content: a table is read at start and again under the lock of each save
        with contextlib.suppress(OSError):
            stat = path.stat()
            seen = (str(path), stat.st_mtime_ns, stat.st_size)
            if seen in _reported:
                return {}
            _reported.add(seen)
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


def merge_table(path: Path, valid: Callable[[object], bool], what: str, merge: Callable[[dict], None]
                ) -> OSError | None:
    """Read `path`, let `merge` add this process's entries to the table, write it back: under a lock file beside it,
    so replicas sharing the cache directory never drop each other's entries (a read-merge-write of two processes at
    once kept only the later writer's). The error when the directory is not writable, else None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(path) + ".lock", timeout=60)
        with lock:
            table = read_table(path, valid, what)
            merge(table)
            return write_table(path, table)
    except (OSError, filelock.Timeout) as exc:
        return exc if isinstance(exc, OSError) else OSError(str(exc))


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:  # the reference and CUDA backends run without it
        return ""


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _candidates_only(table: dict) -> dict:
    """The entries whose config is still one of its kernel's candidates (an edited candidate list is tuned again)."""
    from fusedserve.kernels.triton._common import TUNERS

    def signature(kwargs: dict, warps, stages, ctas, maxnreg) -> tuple:
        return tuple(sorted(kwargs.items())), warps, stages, ctas, maxnreg

    kept = {}
    for name, entries in table.items():
        tuner = TUNERS.get(name)
        if tuner is None or not isinstance(entries, dict):
            continue
        allowed = {signature(c.kwargs, c.num_warps, c.num_stages, c.num_ctas, c.maxnreg) for c in tuner.configs}
        kept[name] = {key: c for key, c in entries.items() if isinstance(c, dict) and isinstance(c.get("kwargs"), dict)
                      and signature(c["kwargs"], c.get("num_warps"), c.get("num_stages"), c.get("num_ctas", 1),
                                    c.get("maxnreg")) in allowed}
    return kept


def _valid_triton(table: object) -> bool:
    return isinstance(table, dict) and all(isinstance(entries, dict) for entries in table.values())


def seed_triton(device: torch.device) -> int:
    """Before the Triton kernels tune anything on `device`: the autotuners take this cache directory's chosen configs,
    then the shipped ones for keys it lacks. Returns how many keys were seeded."""
    from fusedserve.kernels.triton._common import INTERPRET, seed_tuning

    if INTERPRET:  # the interpreter's choices (CPU timings, every config "fits") are not a GPU's
        return 0
    local = read_table(gpu_file("triton", device), _valid_triton, "Triton tuning cache")
    seeded = seed_tuning(_candidates_only(local)) + seed_tuning(_candidates_only(shipped("triton", device)))
    if seeded:
        log.info("Triton: %d tuned configurations taken from the cache and the shipped tuning", seeded)
    return seeded


def save_triton(device: torch.device) -> None:
    """This process's Triton choices into the cache directory's table, merged with what other processes saved."""
    from fusedserve.kernels.triton._common import INTERPRET, tuning_table

    if INTERPRET:
        return
    path = gpu_file("triton", device)

    def merge(table: dict) -> None:
        for name, entries in tuning_table().items():
            table.setdefault(name, {}).update(entries)
    error = merge_table(path, _valid_triton, "Triton tuning cache", merge)
    if error is not None:
        log.warning("cannot save the Triton tuning table %s (%s: %s); the next start tunes again", path,
                    type(error).__name__, error)


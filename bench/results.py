"""The one results format: `bench/results/<gpu>/<suite>.json`, one file per suite per GPU model, holding the newest
run of each of the suite's scenarios under a header that says what ran it (git commit, versions, GPU, clocks).

    {"schema": SCHEMA, "suite": "encoder", "gpu": "h200",
     "scenarios": {"minilm-b1-s16": {"header": {...}, "settings": {...}, "summary": {...}, "results": [{...}]}}}

A run replaces the blocks of the scenarios it ran and keeps the others; a block is always one run's, so every
number in it shares its header. `validate()` is what the tests hold the committed files to.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

SCHEMA = "fusedserve-bench/1"
RESULTS = Path(__file__).resolve().parent / "results"
SUITES = ("kernels", "encoder", "serve")
HEADER_KEYS = ("date", "command", "git_sha", "git_dirty", "python", "torch", "triton", "cuda", "driver", "gpu",
               "clocks", "host")
# the fields every result row of a suite has (a row may hold more)
ROW_KEYS = {
    "kernels": ("op", "dtype", "shape", "provider", "us"),
    "encoder": ("provider", "ms"),
    "serve": (),  # scenarios differ (load points, latency splits, soak counts); each says what it holds
}
# set by bench/gpu.sh to the file `python -m bench.gpu_assets` writes beside the fp16 model copy: the commit a device
# run was made from (the device's copy of the tree has no usable git history of its own)
SOURCE_ENV = "FUSEDSERVE_BENCH_SOURCE"


def gpu_slug(device_name: str | None) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090';
    None (no GPU) -> 'cpu'."""
    if not device_name:
        return "cpu"
    words = [w for w in re.split(r"[\s_-]+", device_name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    picked = []
    for word in words:
        picked.append(re.sub(r"[^a-z0-9]", "", word))
        if re.search(r"\d", word):
            break
    return "-".join(p for p in picked if p) or "gpu"


def default_path(suite: str, device: str) -> Path:
    """bench/results/<gpu>/<suite>.json for the GPU this process sees (cpu without one)."""
    name = None
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
    return RESULTS / gpu_slug(name) / f"{suite}.json"


def git_source() -> tuple[str | None, bool | None]:
    """(commit, tracked files changed since) of the code that runs: from $FUSEDSERVE_BENCH_SOURCE where set, else
    from git, else unknown."""
    source = os.environ.get(SOURCE_ENV)
    if source and Path(source).is_file():
        recorded = json.loads(Path(source).read_text())
        return recorded.get("git_sha"), recorded.get("git_dirty")
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def _nvidia_smi(device_index: int) -> dict:
    fields = ("driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.limit")
    try:
        out = subprocess.run(["nvidia-smi", f"--id={device_index}", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20,
                             check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    return dict(zip(fields, values))


def _number(text: str | None) -> float | None:
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def header(device: str, argv: list[str] | None = None) -> dict:
    """What ran a scenario: date (UTC), the command line, git commit (and whether the tree had uncommitted changes),
    Python, torch, Triton, CUDA, driver, GPU and its clocks at the start, and the host."""
    import torch

    sha, dirty = git_source()
    argv = sys.argv[1:] if argv is None else argv
    out = {
        "date": dt.datetime.now(dt.timezone.utc).date().isoformat(),
        "command": " ".join(["python -m bench", *map(shlex.quote, argv)]),
        "git_sha": sha, "git_dirty": dirty,
        "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
        "cuda": torch.version.cuda, "driver": None, "gpu": None, "clocks": None,
        "host": {"cpu": _cpu_model(), "cores": os.cpu_count()},
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        smi = _nvidia_smi(index)
        out["gpu"] = torch.cuda.get_device_name(index)
        out["driver"] = smi.get("driver_version")
        out["clocks"] = {"sm_mhz": _number(smi.get("clocks.sm")), "mem_mhz": _number(smi.get("clocks.mem")),
                         "max_sm_mhz": _number(smi.get("clocks.max.sm")),
                         "max_mem_mhz": _number(smi.get("clocks.max.mem")),
                         "power_limit_w": _number(smi.get("power.limit"))}
    return out


def block(head: dict, settings: dict, results: list[dict], summary: dict | None = None, *,
          complete: bool = True) -> dict:
    """One scenario's run. complete=False while a run is still adding rows (saved after each, so a run cut short by
    a time limit keeps what it measured and says so)."""
    return {"header": head, "settings": settings, "summary": summary or {}, "results": results, "complete": complete}


def load(path: Path | str) -> dict | None:
    """The results document at `path`, or None if there is none (or it is not in this format)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None


def write(path: Path | str, suite: str, gpu: str, scenario: str, scenario_block: dict) -> Path:
    """Put one scenario's block into the suite's file at `path`, keeping the other scenarios' blocks (a file of
    another suite or GPU, or in another format, is replaced)."""
    path = Path(path)
    doc = load(path)
    if doc is None or doc.get("suite") != suite or doc.get("gpu") != gpu:
        doc = {"schema": SCHEMA, "suite": suite, "gpu": gpu, "scenarios": {}}
    doc["scenarios"][scenario] = scenario_block
    doc["scenarios"] = dict(sorted(doc["scenarios"].items()))
    errors = validate(doc)
    if errors:
        raise ValueError(f"{path}: would not validate: {errors}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def validate(doc: dict) -> list[str]:
    """What is wrong with a results document (empty: nothing)."""
    errors: list[str] = []
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    if doc.get("schema") != SCHEMA:
        errors.append(f"schema is {doc.get('schema')!r}, not {SCHEMA!r}")
    suite = doc.get("suite")
    if suite not in SUITES:
        errors.append(f"suite {suite!r} is not one of {SUITES}")
    if not isinstance(doc.get("gpu"), str) or not doc.get("gpu"):
        errors.append("gpu missing")
    scenarios = doc.get("scenarios")
    if not isinstance(scenarios, dict) or not scenarios:
        return errors + ["no scenarios"]
    for name, entry in scenarios.items():
        where = f"scenarios.{name}"
        if not isinstance(entry, dict):
            errors.append(f"{where} is not an object")
            continue
        for key, kind in (("header", dict), ("settings", dict), ("summary", dict), ("results", list),
                          ("complete", bool)):
            if not isinstance(entry.get(key), kind):
                errors.append(f"{where}.{key} missing or not a {kind.__name__}")
        head = entry.get("header") if isinstance(entry.get("header"), dict) else {}
        missing = [k for k in HEADER_KEYS if k not in head]
        if missing:
            errors.append(f"{where}.header lacks {missing}")
        if not isinstance(head.get("date"), str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", head.get("date") or ""):
            errors.append(f"{where}.header.date is not YYYY-MM-DD")
        if not isinstance(head.get("command"), str) or not head.get("command", "").startswith("python -m bench"):
            errors.append(f"{where}.header.command is not a `python -m bench` command")
        for i, row in enumerate(entry.get("results") or []):
            if not isinstance(row, dict):
                errors.append(f"{where}.results[{i}] is not an object")
                continue
            if "error" in row:  # a provider that failed says why instead of a time
                continue
            lacking = [k for k in ROW_KEYS.get(suite, ()) if k not in row]
            if lacking:
                errors.append(f"{where}.results[{i}] lacks {lacking}")
    return errors


def committed_files() -> list[Path]:
    """Every results file under bench/results/."""
    return sorted(RESULTS.glob("*/*.json"))

"""Which devices a server runs on and which worker runs where (FUSEDSERVE_DEVICE, FUSEDSERVE_WORKERS).

`device` names one device (`cpu`, `cuda:N`), a list of GPUs (`cuda:0,cuda:2`), or every visible GPU (`cuda`, and
`auto` where CUDA is available; `auto` is the CPU elsewhere). `workers` is the number of server processes per
device. One device and one worker: the single-process server, as before. Anything more: the parent process places
`workers` processes on each device (server.workers), each loading its models on that one device.

This module decides without touching a GPU (the parent must not create a CUDA context on every device it hands
out): it counts the visible GPUs through the model package (fusedserve.model.host: torch's device count, which uses
NVML where it can) and reads their free memory from nvidia-smi."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fusedserve.model import host

log = logging.getLogger("fusedserve")

PATTERN = r"^(auto|cpu|cuda|cuda:\d+(,cuda:\d+)*)$"

# WORKERS=auto: the host CPUs one worker keeps busy feeding a GPU (parsing, tokenizing, answering: the host path is
# the ceiling of one process), the most per GPU (beyond it the GPU is the limit: docs/performance.md), and the GPU
# memory one worker needs beside its weights (CUDA context, allocator pools, CUDA graphs, activations)
CPUS_PER_WORKER = 2
MAX_WORKERS_PER_GPU = 4
WORKER_OVERHEAD_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Placement:
    """One worker's device: `name` is what /info and the metrics call it; `runs_on` what its models load on (the
    same, outside the tests' fake devices)."""

    name: str
    runs_on: str


def visible_gpus() -> list[str]:
    """Every GPU this process may use, as `cuda:N` (CUDA_VISIBLE_DEVICES applies)."""
    return host.gpus()


def runs_on(name: str) -> str:
    """The torch device a worker placed on `name` loads its models on."""
    return name


def devices(setting: str) -> list[str]:
    """The device setting as a list of device names. A named GPU that is not visible stays in the list: its workers
    fail their start, and the device is left out then, saying why (server.workers)."""
    if setting == "cpu":
        return ["cpu"]
    if setting in ("auto", "cuda"):
        gpus = visible_gpus()
        if gpus:
            return gpus
        if setting == "cuda":
            raise ValueError("device 'cuda' asks for every visible GPU, and this machine shows none")
        return ["cpu"]
    names = setting.split(",")
    if len(set(names)) != len(names):
        raise ValueError(f"device {setting!r} names a GPU twice")
    return names


def place(setting: str, workers: int | str, model_bytes: int | None = None) -> list[Placement]:
    """Every worker's device, the workers of a device together: `workers` per device, or with "auto" as many as
    the CPUs, the GPU's free memory and MAX_WORKERS_PER_GPU allow (one on the CPU)."""
    names = devices(setting)
    per = workers if isinstance(workers, int) else auto_workers(names, model_bytes)
    return [Placement(name, runs_on(name)) for name in names for _ in range(per)]


def auto_workers(names: list[str], model_bytes: int | None) -> int:
    """Workers per device for WORKERS=auto. The CPU: one (a process uses every core through its intra-op threads,
    and a second only splits them: docs/performance.md). A GPU: the host CPUs shared out at CPUS_PER_WORKER each,
    at most MAX_WORKERS_PER_GPU, and no more than the least free memory of the devices holds (the model's weights,
    as its files hold them, plus WORKER_OVERHEAD_BYTES each); at least one."""
    if names == ["cpu"]:
        return 1
    by_cpus = max(1, usable_cpus() // (CPUS_PER_WORKER * len(names)))
    known = [b for b in map(free_bytes, names) if b is not None]
    free = min(known) if known else None
    need = (model_bytes or 0) + WORKER_OVERHEAD_BYTES
    by_memory = max(1, free // need) if free is not None else MAX_WORKERS_PER_GPU
    count = min(by_cpus, by_memory, MAX_WORKERS_PER_GPU)
    log.warning("WORKERS=auto: %d per device on %s (CPUs allow %d, free GPU memory %s, at most %d)", count,
                ",".join(names), by_cpus, "unknown" if free is None else f"{free / 1024**3:.1f} GiB for {by_memory}",
                MAX_WORKERS_PER_GPU)
    return count


def free_bytes(name: str) -> int | None:
    """Free memory of GPU `name` by nvidia-smi (through CUDA_VISIBLE_DEVICES' mapping), None where it cannot say.
    Not torch.cuda.mem_get_info: that creates a CUDA context on the device, in a parent that never uses it."""
    index = name.split(":")[1]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [v.strip() for v in visible.split(",")]
        index = entries[int(index)] if int(index) < len(entries) else index
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-i", index, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) * 1024**2  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def model_bytes(path: str) -> int | None:
    """The weights' bytes of a model directory (its safetensors / bin files), None for a preset or the default."""
    p = Path(path)
    if not p.is_dir():
        return None
    files = [*p.glob("*.safetensors"), *p.glob("*.bin")]
    return sum(f.stat().st_size for f in files) or None


def usable_cpus() -> int:
    """This process's CPU affinity, capped by a cgroup v2 CPU quota (a container's limit, where the affinity still
    lists every core of the node)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]  # "max 100000" or "200000 100000"
        return cpus if quota == "max" else min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        return cpus


def ensure_mps(names: list[str], per_device: int) -> str:
    """Several workers on one GPU share it concurrently only under CUDA MPS; without it their kernels time-slice.
    Finds a running MPS control daemon, else starts one where its binary is here and the pipe directory is ours to
    write; says which in the return value (for the start-up log)."""
    if per_device <= 1 or not any(n.startswith("cuda") for n in names):
        return "not needed"
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    if (pipe / "control").exists():
        return f"running ({pipe})"
    binary = shutil.which("nvidia-cuda-mps-control")
    if binary is None:
        return "not available (no nvidia-cuda-mps-control here): the workers' kernels time-slice the GPU"
    try:
        subprocess.run([binary, "-d"], check=True, timeout=30, capture_output=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not be started ({exc}): the workers' kernels time-slice the GPU"
    return f"started ({pipe})"

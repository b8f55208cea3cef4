"""What the server asks of the machine its models run on, answered here because the model package owns torch: the
GPUs this process sees, where a device setting puts a model, the intra-op threads, and the device memory torch's
allocator holds. The one device decision: model loading (model/loading.py) and the server's placement and defaults
(server/devices.py, server/config.py) both resolve a setting with `place`.

Importing this module loads no torch: each function imports it when called, so the server's modules (and a parent
of workers that never loads a model) stay free of torch until a model loads.
"""

from __future__ import annotations


def gpus() -> list[str]:
    """Every GPU this process may use, as `cuda:N` (CUDA_VISIBLE_DEVICES applies); [] without CUDA."""
    import torch

    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def place(device: str) -> str:
    """The device a model with the `device` setting loads on: "auto" is the current GPU where CUDA is available,
    else the CPU; "cpu", "cuda" and "cuda:N" as they are. A GPU asked for where CUDA is missing is a ValueError
    naming the setting."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)  # a malformed name is torch's ValueError/RuntimeError, naming it
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available here")
    return device


def on_gpu(device: str) -> bool:
    """Whether a model with the `device` setting runs on a GPU (without loading torch where the setting says)."""
    if device == "auto":
        return place(device) != "cpu"
    return device.startswith("cuda")


def threads() -> int:
    """torch's intra-op threads in this process."""
    import torch

    return torch.get_num_threads()


def set_threads(count: int) -> None:
    """torch's intra-op threads in this process (before any model loads: oneDNN sizes its pools then)."""
    import torch

    torch.set_num_threads(count)


def memory(device: str) -> tuple[int, int]:
    """(allocated, reserved) bytes of torch's CUDA allocator on `device` in this process; (0, 0) on the CPU or
    before CUDA is initialized (reading them then would create a context)."""
    import torch

    where = torch.device(device)
    if where.type != "cuda" or not torch.cuda.is_initialized():
        return 0, 0
    return torch.cuda.memory_allocated(where), torch.cuda.memory_reserved(where)

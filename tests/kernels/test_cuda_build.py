"""The CUDA extension builds from Python on a machine without a GPU (sources + binding.cpp against this torch,
for sm_90), lands in the persistent cache, and a second start loads it from there; missing nvcc is reported
as a reason, not a crash. The kernels themselves run in test_cuda_ops.py on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from fusedserve.kernels.cuda import build
from tests.conftest import require_tool


@pytest.mark.slow  # nvcc builds the whole extension
def test_builds_into_the_cache_and_loads_from_it_the_second_time(tmp_path):
    require_tool("nvcc", "FUSEDSERVE_REQUIRE_NVCC", path=build.cuda_home())  # the toolkit, found as the build finds it
    env = {**os.environ, "FUSEDSERVE_CUDA_CACHE": str(tmp_path), "TORCH_CUDA_ARCH_LIST": "9.0"}
    cmd = [sys.executable, "-m", "fusedserve.kernels.cuda.build"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "building the CUDA extension" in first.stderr and "built in" in first.stderr
    assert "torch.ops.fusedserve_cuda: norm, embedding_norm, bias_act" in first.stdout
    libraries = list(tmp_path.glob("fusedserve_cuda-*/fusedserve_cuda*.so"))
    assert len(libraries) == 1
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "loaded from cache" in second.stderr, second.stderr[-2000:]
    assert "building" not in second.stderr
    # a pre-built cache needs neither nvcc nor write access (the GPU image's read-only layer)
    for path in [tmp_path, *tmp_path.rglob("*")]:
        path.chmod(path.stat().st_mode & 0o555)
    try:
        third = subprocess.run(cmd, env={**env, "CUDA_HOME": "/nonexistent", "PATH": "/usr/bin:/bin"},
                               capture_output=True, text=True, timeout=300)
    finally:
        for path in [tmp_path, *tmp_path.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o700)
    assert third.returncode == 0 and "loaded from cache" in third.stderr, third.stderr[-2000:]


def test_cache_key_follows_sources_torch_and_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDSERVE_CUDA_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    a = build.build_dir()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert build.build_dir() != a and build.build_dir().parent == tmp_path


def test_missing_toolkit_is_a_reason(monkeypatch):
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "cuda_home", lambda: None)
    monkeypatch.setattr(build, "library_path", lambda: build.Path("/nonexistent/fusedserve_cuda.so"))
    with pytest.raises(build.BuildUnavailable, match="nvcc not found and no pre-built extension"):
        build.load()


@pytest.fixture
def fake_toolchain(monkeypatch, tmp_path):
    """build.load with nvcc replaced by a slow fake: it 'links' the library in two writes, as a linker does."""
    from torch.utils import cpp_extension

    builds, loaded = [], []

    def link(name, sources, build_directory, **kwargs):
        library = build.Path(build_directory) / f"{name}.so"
        builds.append(build_directory)
        library.write_bytes(b"\x7fELF half")
        seen_while_linking.append(build.library_path().exists())
        time.sleep(0.3)
        with library.open("ab") as f:
            f.write(b" and the rest")
        loaded.append(str(library))

    seen_while_linking: list[bool] = []
    monkeypatch.setenv("FUSEDSERVE_CUDA_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "cuda_home", lambda: tmp_path)
    monkeypatch.setattr(build.torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", link)
    monkeypatch.setattr(build.torch.ops, "load_library", loaded.append)
    return builds, loaded, seen_while_linking


def test_a_library_being_linked_is_never_at_the_path_other_processes_load(fake_toolchain):
    builds, loaded, seen_while_linking = fake_toolchain
    directory = build.load()
    assert seen_while_linking == [False]  # the build wrote elsewhere and was renamed into place whole
    assert build.library_path().read_bytes() == b"\x7fELF half and the rest"
    assert directory == build.build_dir() and not list(directory.parent.glob("*.tmp"))


def test_replicas_sharing_the_cache_build_once(fake_toolchain, monkeypatch):
    builds, loaded, _ = fake_toolchain
    results, start = [], threading.Barrier(3)

    def replica():
        start.wait()
        build._loaded = None  # each thread plays a process of its own
        results.append(build.load())

    threads = [threading.Thread(target=replica) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 3 and len(builds) == 1, builds  # the others waited on the lock, then loaded its library
    assert str(build.library_path()) in loaded

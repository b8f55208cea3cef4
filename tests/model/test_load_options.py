"""The choices and defaults the model package offers (fusedserve.model.api, fusedserve.model.host) are the ones the
kernels implement and the server's settings take: one source, read by both sides."""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch

from fusedserve.kernels import registry
from fusedserve.model import api, host, load, modules
from fusedserve.server.config import Settings


def _choices(annotation) -> set[str]:
    """The string choices of a Literal annotation, through Optional and dict[str, Literal] wrappers."""
    found: set[str] = set()
    for arg in typing.get_args(annotation) or ():
        if isinstance(arg, str):
            found.add(arg)
        else:
            found |= _choices(arg)
    return found


def test_the_backends_offered_are_the_kernel_layers():
    assert list(api.BACKENDS) == ["auto", *registry.backend_names()]


def test_the_pooling_modes_are_the_ones_the_pooling_implements():
    assert modules.POOLING_MODES is api.POOLING_MODES


@pytest.mark.parametrize("setting, offered", [
    ("backend", api.BACKENDS), ("backend_overrides", api.BACKENDS), ("pooling", api.POOLING_MODES),
    ("dtype", api.DTYPES), ("attention", api.ATTENTION_MODES), ("precision", api.PRECISIONS),
])
def test_the_server_offers_what_the_model_package_names(setting, offered):
    assert _choices(Settings.model_fields[setting].annotation) == set(offered)


def test_the_batch_defaults_have_one_source():
    assert Settings.model_fields["max_batch_tokens"].default == api.GPU_BATCH_TOKENS
    assert Settings.model_fields["max_batch_requests"].default == api.BATCH_INPUTS
    assert Settings(device="cpu").max_batch_tokens == api.CPU_BATCH_TOKENS
    assert Settings(device="cuda:0").max_batch_tokens == api.GPU_BATCH_TOKENS
    assert Settings(device="cpu", max_batch_tokens=777).max_batch_tokens == 777
    assert api.LoadOptions().max_batch == api.BATCH_INPUTS
    served = load("tiny", api.LoadOptions(device="cpu"))  # no limit given: the device's default
    assert served.embedder.max_batch_tokens == api.CPU_BATCH_TOKENS


def test_the_device_decision_is_the_model_packages():
    cuda = torch.cuda.is_available()
    assert host.on_gpu("cpu") is False
    assert host.on_gpu("cuda:1") is True and host.on_gpu("cuda") is True
    assert host.on_gpu("auto") is cuda
    assert host.place("auto") == ("cuda" if cuda else "cpu")
    assert host.gpus() == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert host.memory("cpu") == (0, 0)
    if not cuda:
        with pytest.raises(ValueError, match="'cuda:0' requested but CUDA is not available"):
            host.place("cuda:0")


def test_out_of_device_memory_crosses_the_seam_as_its_own_error(monkeypatch):
    """torch's out-of-memory, raised inside a forward, reaches the server as api.OutOfDeviceMemory (the batcher
    splits the batch on it) and never as a torch type."""
    served = load("tiny", api.LoadOptions(device="cpu"))

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(served.embedder, "launch_ids", out_of_memory)
    rows = api.Rows.of([[101, 2023, 102]])
    with pytest.raises(api.OutOfDeviceMemory, match="Tried to allocate") as caught:
        served.launch(rows)
    assert isinstance(caught.value.__cause__, torch.cuda.OutOfMemoryError)
    assert served.launch(rows, reference=True).rows().shape[0] == 1
    assert np.isfinite(served.launch(rows, reference=True).rows()).all()


def test_a_dtype_the_family_is_not_served_in_is_refused_before_the_weights_load(tmp_path):
    """EmbeddingGemma is served in float32 and bfloat16: float16 is refused from config.json alone (the directory
    here has no weights at all, which would be the error otherwise), on any device, naming the dtypes it takes."""
    from fusedserve.model.config import UnsupportedModel
    from tests.model import checkpoints

    path = checkpoints.gemma3(tmp_path / "gemma")
    (path / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModel, match=r"dtype float16 is not supported by EmbeddingGemma \(Gemma3\): it is "
                                               r"served in float32 and bfloat16"):
        load(str(path), api.LoadOptions(device="cpu", dtype="float16"))
    with pytest.raises(Exception, match="has no model.safetensors"):  # a dtype it is served in gets that far
        load(str(path), api.LoadOptions(device="cpu", dtype="float32"))

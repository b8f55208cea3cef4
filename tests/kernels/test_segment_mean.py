"""segment_mean (the packed batch's mean pooling) beyond the generic sweeps: a hand-computed case, empty segments,
filler rows that must never be read, offsets out of range, int64 offsets, strided rows, NaN inside a segment, clear
errors, and the encoder's packed pooling through it against the index_add path it replaced. Triton runs on the
interpreter here (and on the GPU with -m gpu); the CUDA kernel runs on the GPU."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels import reference
from fusedserve.kernels.testing import compare, float64_reference
from fusedserve.kernels.triton import LAUNCHERS

NAN = float("nan")


def _triton():
    return LAUNCHERS["segment_mean"]


def _cuda():
    from fusedserve.kernels import cuda

    return cuda.load()["segment_mean"]  # on a GPU machine a build failure fails the test (as in test_cuda_ops.py)


def _implementations(device):
    impls = {"reference": reference.segment_mean, "triton": _triton()}
    if device == "cuda":
        impls["cuda"] = _cuda()
    return impls


def _case(device):
    # 7 rows: segments [0, 2), [2, 2) (empty), [2, 5), then two filler rows of NaN
    x = torch.tensor([[1.0, 2.0], [3.0, 6.0], [0.0, 1.0], [3.0, 1.0], [6.0, 1.0], [NAN, NAN], [NAN, NAN]])
    return x.to(device), torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hand_computed_means_empty_segment_and_unread_filler(device, dtype):
    x, cu = _case(device)
    want = torch.tensor([[2.0, 4.0], [0.0, 0.0], [3.0, 1.0]])
    for name, fn in _implementations(device).items():
        got = fn(x.to(dtype), cu)
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=name)


def test_offsets_are_clamped_to_the_rows(device):
    x = torch.randn(5, 3, device=device) + 1.0
    cu = torch.tensor([-4, 2, 9, 1], dtype=torch.int64, device=device)  # [0, 2), [2, 5), then [5, 5) (empty)
    want = torch.stack([x[:2].mean(0), x[2:].mean(0), torch.zeros(3, device=device)]).cpu()
    for name, fn in _implementations(device).items():
        torch.testing.assert_close(fn(x, cu).cpu(), want, msg=name)


def test_int64_offsets_strided_rows_and_nan_inside_a_segment(device):
    gen = torch.Generator().manual_seed(11)
    wide = (torch.randn(300, 2 * 769, generator=gen) + 0.5).to(device)
    x = wide[:, :769]  # row stride 1538: not contiguous
    x[17, 5] = NAN  # inside the second segment only
    cu = torch.tensor([0, 10, 40, 41, 41, 290], dtype=torch.int64, device=device)
    want = float64_reference("segment_mean", (x, cu), {})
    assert want[1, 5].isnan() and not want[[0, 2, 4]].isnan().any()
    for name, fn in _implementations(device).items():
        report = compare(fn(x, cu), want, torch.float32)
        assert report.ok, (name, report)


def test_no_segments_and_clear_errors(device):
    fn = _triton()
    x = torch.randn(4, 8, device=device)
    assert fn(x, torch.zeros(1, dtype=torch.int32, device=device)).shape == (0, 8)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        fn(x, torch.tensor([0.0, 4.0], device=device))
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden\]"):
        fn(x[None], torch.tensor([0, 4], device=device))
    with pytest.raises(ValueError, match="out must be"):
        fn(x, torch.tensor([0, 4], device=device), out=torch.empty(1, 8, dtype=torch.float16, device=device))


def test_packed_pooling_through_segment_mean_equals_the_torch_path():
    """The encoder's pooling of a packed batch (filler tokens and filler sequences of a larger bucket) through
    segment_mean, on the reference and on a fused backend (Triton, on the interpreter here), gives what the torch
    index_add path gives (the path of a Packed without offsets)."""
    import dataclasses

    from fusedserve import kernels
    from fusedserve.model.packing import Packed, packed_mean_pool

    rows = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    p = Packed.from_rows(rows, "cpu", tokens=12, batch=5, seq=6)
    hidden = torch.randn(12, 16, generator=torch.Generator().manual_seed(2)) * 3 + 1
    hidden[9:] = NAN  # filler tokens: no path may read them into a real sequence
    torch_path = packed_mean_pool(hidden, dataclasses.replace(p, cu_seqlens=None), normalize=False)
    assert kernels.current().impls["segment_mean"] is reference.segment_mean
    on_reference = packed_mean_pool(hidden, p, normalize=False)
    _triton()
    selection = kernels.select("cpu", (torch.float32,), backend="triton")
    assert selection.backend_of("segment_mean") == "triton"
    with kernels.use(selection):
        fused = packed_mean_pool(hidden, p, normalize=False)
    for pooled in (on_reference, fused):
        torch.testing.assert_close(pooled[:3], torch_path[:3], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pooled[1], hidden[3])
        torch.testing.assert_close(pooled[2], hidden[4:9].mean(0))


def test_reference_path_forward_and_pooling_never_read_device_values_on_the_host():
    """The model captures its forward + pooling in CUDA graphs on the reference path too (fused path off), and a
    capture fails on any host synchronization (a tensor value read on the host: .item(), int(t), a data-dependent
    shape). Fake tensors fail the same way (DataDependentOutputException), so this is the CPU check of it: the first
    reference segment_mean (int(cu[-1]), repeat_interleave) failed here as it failed capture on the H200."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusedserve.model.config import EncoderConfig
    from fusedserve.model.bert import Encoder
    from fusedserve.model.packing import Packed, packed_mean_pool

    encoder = Encoder(dataclasses.replace(EncoderConfig.from_name("tiny"), num_layers=1)).eval()
    p = Packed.from_rows([[101, 5, 6, 102], [101, 7, 102]], "cpu", tokens=12, batch=4, seq=8)
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        x, cu = torch.randn(20, 8), torch.tensor([0, 5, 5, 17], dtype=torch.int32)
        assert reference.segment_mean(x, cu).shape == (3, 8)
        assert packed_mean_pool(encoder.forward_packed(p, "pad"), p, normalize=False).shape == (4, 64)


@pytest.mark.gpu
def test_cuda_scalar_path_for_misaligned_rows():
    fn = _cuda()
    base = torch.randn(64 * 385 + 1, device="cuda", dtype=torch.float16) + 0.5
    x = base[1:].view(64, 385)  # odd width, base off 16-byte alignment: the scalar path
    cu = torch.tensor([0, 1, 33, 33, 60], dtype=torch.int32, device="cuda")
    report = compare(fn(x, cu), float64_reference("segment_mean", (x, cu), {}), torch.float16)
    assert report.ok, report


@pytest.mark.gpu
def test_every_implementation_runs_inside_a_cuda_graph():
    """The model pools inside its CUDA graphs, on the reference path too (fused path off): no implementation may
    synchronize with the host (the first reference did, and capture failed)."""
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(300, 384, generator=gen) + 0.5).to("cuda", torch.float16)
    cu = torch.tensor([0, 16, 16, 200, 290], dtype=torch.int32, device="cuda")
    want = float64_reference("segment_mean", (x, cu), {})
    for name, fn in _implementations("cuda").items():
        fn(x, cu)  # warm: compilation outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fn(x, cu)
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        report = compare(got, want, torch.float16)
        assert report.ok, (name, report)

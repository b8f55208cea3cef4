"""The server treats the model as a black box: it changes the kernel path only through the Embedder, so the
verifier's fallback behaves exactly like the admin switch (attention follows, metrics and /info say the truth),
and it never imports the kernels package. In-process services on the tiny preset, the Triton kernels on the
interpreter standing in for a GPU's fused backend."""

from __future__ import annotations

import ast
import asyncio
import pathlib
import time

import pytest
import torch

from fusedserve.server.config import Settings
from fusedserve.server.model_service import ModelService
from fusedserve.server.service import Service

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _serve(settings: Settings) -> Service:
    service = Service(settings)
    service.load()
    service.mark_ready()
    return service


def _embed(service: Service | ModelService, rows: list[list[int]]):
    service = service.default if isinstance(service, Service) else service

    async def run():
        return await service.batcher.submit(await service.prepare(rows), 60).future

    return asyncio.run(run())


def _fall_back_by_verifier(service: Service, op: str = "linear_add_layer_norm") -> None:
    """Make the served path drift (one op's output tilted, as tests.support.server's faults do), send a batch, and
    wait for the verifier to see the mismatch and fall back."""
    served = service.default
    e = served.model.embedder  # past the seam, as tests.support.server's faults reach it
    original = e.kernel_path.selection.impls[op]

    def drifting(*args, **kwargs):
        out = original(*args, **kwargs)
        return out.add_(torch.linspace(-0.5, 0.5, out.shape[-1], dtype=out.dtype))

    path = e.kernel_path
    served.batcher.between_batches(lambda: path.use(path.selection.with_impl(op, drifting, "test drift"))).result(10)
    _embed(served, [[101, 2023, 2003, 102]])
    deadline = time.monotonic() + 60
    while (fallback := service.info()["fallback"]) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fallback == "verify_mismatch"


def _kernel_samples(service: Service) -> dict[tuple[str, str], float]:
    out = {}
    for family in service.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "fusedserve_kernel_duration_seconds_count":
                out[(sample.labels["op"], sample.labels["backend"])] = sample.value
    return out


def _idle(service: Service) -> None:
    """Until the worker has been idle: a sampled batch's timing still waiting has run (it goes before idle work)."""
    service.default.batcher.when_idle(lambda: None).result(30)


def _samples_after(service: Service, before: dict) -> dict[tuple[str, str], float]:
    """The kernel-duration counts once they differ from `before`: a sampled batch's ops are timed after it is
    answered, at the worker's next idle moment."""
    deadline = time.monotonic() + 30
    while (samples := _kernel_samples(service)) == before:
        assert time.monotonic() < deadline, "no sampled batch was timed"
        time.sleep(0.02)
    return samples


def test_kernel_timings_after_a_verify_fallback_are_labelled_with_the_reference():
    """Regression: the verifier's fallback used to swap the ops to the reference behind the registry's back, so
    sampled kernel timings kept the fused backend's label, and /info still showed the fused choices."""
    service = _serve(Settings(model="tiny", device="cpu", backend="triton", warmup=False, kernel_timing_sample_rate=1,
                              verify_sample_rate=1, verify_action="fallback", verify_tolerance=1e-4))
    try:
        _embed(service, [[101, 2023, 102]])
        assert {backend for _, backend in _samples_after(service, {})} == {"triton"}
        _fall_back_by_verifier(service)
        _idle(service)
        before = _kernel_samples(service)
        _embed(service, [[101, 2023, 2003, 1037, 102]])
        after = _samples_after(service, before)
        grew = {key for key, count in after.items() if count > before.get(key, 0)}
        assert grew and {backend for _, backend in grew} == {"torch"}, grew
        info = service.info()
        assert info["fused"] is False and info["fallback"] == "verify_mismatch"
        assert {v["backend"] for v in info["kernels"].values() if v.get("used", True)} == {"torch"}
        assert all(v["reason"] == "fallback: verify_mismatch" for v in info["kernels"].values() if v.get("used", True))
    finally:
        service.shutdown()


def _cpu_varlen(q, k, v, cu_q, cu_k, max_q, max_k):
    """torch's varlen attention's contract on the CPU ([tokens, heads, dim] packed by cu_seqlens)."""
    out = torch.zeros_like(q)
    cu = cu_q.tolist()
    for start, end in zip(cu, cu[1:]):
        if end > start:
            sl = slice(start, end)
            ctx = torch.nn.functional.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                                                   v[sl].transpose(0, 1))
            out[sl] = ctx.transpose(0, 1)
    return out


def test_a_verify_fallback_takes_auto_attention_off_the_few_token_layer(monkeypatch):
    """Regression: the fused switch moved auto attention to varlen when the few-token ops landed on the reference,
    but the verifier's fallback bypassed it, so every batch of <= 64 tokens ran attention_partials, ffn_partials
    and partial_add_layer_norm on their slow torch references. The CPU stands in for a GPU where varlen runs."""
    import fusedserve.model.packing as packing_module

    monkeypatch.setattr(packing_module, "varlen_runs", lambda device, dtype: True)
    monkeypatch.setattr(packing_module, "varlen_attention", lambda: _cpu_varlen)
    service = _serve(Settings(model="tiny", device="cpu", backend="triton", warmup=False, kernel_timing_sample_rate=1,
                              verify_sample_rate=1, verify_action="fallback", verify_tolerance=1e-4))
    try:
        assert service.info()["attention"] == "fused"
        _embed(service, [[101, 2023, 102]])
        assert ("attention_partials", "triton") in _samples_after(service, {})
        _fall_back_by_verifier(service, "partial_add_layer_norm")  # an op of the few-token layer
        info = service.info()
        assert info["attention"] == "varlen" and "reference" in info["attention_reason"], info["attention_reason"]
        _idle(service)
        before = _kernel_samples(service)
        _embed(service, [[101, 2023, 2003, 102]])  # a few tokens: the few-token layer's batch size
        grew = {op for (op, _), count in _samples_after(service, before).items() if count > before.get((op, _), 0)}
        assert grew and not grew & {"attention_partials", "ffn_partials", "partial_add_layer_norm"}, grew
    finally:
        service.shutdown()


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_server_never_imports_the_kernels_package():
    """The model owns the kernel path; the server reaches it only through model.runner.Embedder."""
    files = sorted((ROOT / "server").rglob("*.py"))
    assert len(files) > 5
    offenders = {str(f.relative_to(ROOT)): sorted(n for n in _imports(f) if n == "kernels" or n.startswith("kernels."))
                 for f in files}
    assert {f: names for f, names in offenders.items() if names} == {}


OP_TABLES = {"impls", "choices"}  # a Selection's two tables, op -> implementation and op -> choice
MUTATORS = {"update", "pop", "popitem", "clear", "setdefault", "__setitem__", "__delitem__"}


def _table_writes(source: str) -> list[str]:
    """Each place in `source` that changes an op table in place: an item of `.impls` or `.choices` assigned or
    deleted, such a table assigned (plainly or through __setattr__), or a mutating method called on one."""
    def is_table(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in OP_TABLES

    def flat(targets):
        for target in targets:
            yield from flat(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else (target,)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            targets = []
        for target in flat(targets):
            if is_table(target) or (isinstance(target, ast.Subscript) and is_table(target.value)):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                (node.func.attr in MUTATORS and is_table(node.func.value))
                or (node.func.attr == "__setattr__" and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in OP_TABLES)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_op_tables_hold_the_op_list_and_change_only_by_a_new_selection():
    """No module-level mutable op table: the registry returns selections that hold every op of the op list, cannot
    be written, and change only by making a new selection (with a new version, which CUDA graphs are keyed on); the
    Embedder keeps its own. Nothing in the server, the model, the command or the benchmarks writes a table."""
    from fusedserve import kernels
    from fusedserve.kernels import registry
    from fusedserve.kernels.spec import OPS, REFERENCE_OPS

    assert not hasattr(registry, "active") and not hasattr(kernels, "reference_path")
    selection = kernels.select("cpu", (torch.float32,), fused=False)
    # what the table must hold: every op once, each on its torch reference, saying why
    assert list(selection.impls) == list(selection.choices) == list(OPS)
    assert {op: fn for op, fn in selection.impls.items() if fn is not REFERENCE_OPS[op]} == {}
    reasons = {(c.backend, c.reason) for c in selection.choices.values()}
    assert reasons == {("torch", "fused path disabled by configuration")}, reasons
    op = OPS[0]
    for table in (selection.impls, selection.choices):
        with pytest.raises(TypeError):
            table[op] = None
        with pytest.raises(TypeError):
            del table[op]
    # a change of path is a new selection; the one it came from is as it was
    def replacement(*args, **kwargs):
        return REFERENCE_OPS[op](*args, **kwargs)

    changed = selection.with_impl(op, replacement, "a test's replacement")
    assert changed.impls[op] is replacement and changed.choices[op].reason == "a test's replacement"
    assert selection.impls[op] is REFERENCE_OPS[op] and changed.version > selection.version
    back = changed.on_reference([op], "back to the reference")
    assert back.impls[op] is REFERENCE_OPS[op] and changed.impls[op] is replacement

    # the scan finds each way of writing a table (it is the check below, so it must be able to fail)
    writes = ["s.impls[op] = f", 's.impls["layer_norm"] = f', "s.choices[op], x = c, 1", "del s.impls[op]",
              "s.impls[op] += f", "s.impls = {}", "s.impls.update(x)", "s.choices.pop(op)",
              'object.__setattr__(s, "impls", {})']
    assert [w for w in writes if not _table_writes(w)] == []
    assert _table_writes("f = s.impls[op]\nbackend = s.choices[op].backend\nops = list(s.impls)") == []
    files = [path for folder in ("server", "model", "fusedserve", "bench") for path in (ROOT / folder).rglob("*.py")]
    assert len(files) > 10
    found = {str(path.relative_to(ROOT)): lines for path in files if (lines := _table_writes(path.read_text()))}
    assert found == {}

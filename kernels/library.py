"""torch.library custom ops for the fused backends, derived from kernels.spec: each op of each backend becomes
`fusedserve::<backend>_<op>`, one opaque node to torch.compile (no graph breaks, no tracing into launchers), with
the spec's fake implementation for shape propagation and, where the spec says so, autograd recomputed through the
fp32 torch reference (backward passes are for fine-tuning and tests, not the serving hot path).

Eager calls skip the custom-op dispatcher (its per-call cost is a small kernel's whole time) and go straight to the launcher,
unless torch.compile is tracing or autograd needs the graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from fusedserve.kernels.spec import OP_SPECS, OpSpec

_cache: dict[str, dict[str, Callable]] = {}

# the reference's annotations (strings: `from __future__ import annotations`) -> torch schema types
_SCHEMA_TYPES = {"Tensor": "Tensor", "Tensor | None": "Tensor?", "float": "float", "int": "int", "int | None": "int?",
                 "str": "str", "bool": "bool"}


def signature(spec: OpSpec) -> inspect.Signature:
    """The op's signature: its reference's, less the `out=` tensor every launcher also takes."""
    sig = inspect.signature(spec.reference)
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "out"])


def schema(spec: OpSpec) -> str:
    """The custom op's schema, every argument positional: `(Tensor x, Tensor weight, ...) -> Tensor`."""
    args = ", ".join(f"{_SCHEMA_TYPES[p.annotation]} {p.name}" for p in signature(spec).parameters.values())
    returns = "(Tensor, Tensor)" if "tuple" in str(signature(spec).return_annotation) else "Tensor"
    return f"({args}) -> {returns}"


def _eager(args: tuple) -> bool:
    """True when the launcher can be called directly: not tracing, and no input wants a gradient."""
    if torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled():
        return not any(isinstance(a, Tensor) and a.requires_grad for a in args)
    return True


def _call(fn: Callable, sig: inspect.Signature, values: list) -> object:
    """fn called with the schema's positional `values`, keyword-only parameters passed by name."""
    args, kwargs = [], {}
    for p, v in zip(sig.parameters.values(), values):
        if p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = v
        else:
            args.append(v)
    return fn(*args, **kwargs)


def _two_outputs(launcher: Callable) -> Callable:
    """add_layer_norm as a custom op always returns (y, pre-norm sum), the sum empty unless asked for."""
    def impl(*args):
        if args[-1]:
            return launcher(*args[:-1], return_sum=True)
        return launcher(*args[:-1]), args[0].new_empty(0)
    return impl


def _autograd(spec: OpSpec, op) -> None:
    """Backward through the fp32 reference, recomputed at the saved inputs."""
    def setup(ctx, inputs, output):
        ctx.slots = [i for i, a in enumerate(inputs) if isinstance(a, Tensor)]
        ctx.constants = [None if isinstance(a, Tensor) else a for a in inputs]
        ctx.save_for_backward(*(inputs[i] for i in ctx.slots))

    def backward(ctx, *grads_out):
        args = list(ctx.constants)
        leaves = []
        with torch.enable_grad():
            for i, t in zip(ctx.slots, ctx.saved_tensors):
                args[i] = t.detach().requires_grad_(t.is_floating_point())
                leaves.append(args[i])
            outs = _call(spec.reference, signature(spec), args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads_out) if g is not None and g.numel()]
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        grads: list[Tensor | None] = [None] * len(args)
        for i, leaf in zip(ctx.slots, leaves):
            grads[i] = next(got) if leaf.requires_grad else None
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup)


def _define(backend: str, spec: OpSpec, launcher: Callable) -> Callable:
    two = "(Tensor, Tensor)" in schema(spec)
    op = torch.library.custom_op(f"fusedserve::{backend}_{spec.name}", _two_outputs(launcher) if two else launcher,
                                 mutates_args=(), schema=schema(spec))
    op.register_fake(spec.fake)
    if spec.differentiable:
        _autograd(spec, op)
    sig = signature(spec)

    def call(*args, out: Tensor | None = None, **kwargs):
        if out is not None or _eager((*args, *kwargs.values())):
            return launcher(*args, **kwargs, out=out)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        result = op(*bound.arguments.values())  # keyword-only ones too, in signature order
        if two and not bound.arguments["return_sum"]:
            return result[0]
        return result

    call.__name__ = call.__qualname__ = spec.name
    call.__doc__ = spec.doc
    return call


def loaded(backend: str) -> dict[str, Callable]:
    """The callables custom_ops made for `backend` (the registry loaded it)."""
    return _cache[backend]


def custom_ops(backend: str, launchers: Mapping[str, Callable]) -> dict[str, Callable]:
    """The registry-facing callables of a backend: {op: callable} for the ops it implements (kernels.spec's
    fused_in), each defined once per process."""
    if backend not in _cache:
        _cache[backend] = {op: _define(backend, spec, launchers[op]) for op, spec in OP_SPECS.items()
                           if backend in spec.fused_in}
    return _cache[backend]

"""The kernel path one model runs on: its kernel Selection, the attention mode that follows from it, the fused
switch's fallback and PRECISION=fp8's tier. KernelPath is the only way anything outside changes them (set_fused,
fall_back, fall_back_precision, use), always between forwards; the forwards (model.forwards) read it."""

from __future__ import annotations

import logging

import torch

from fusedserve import kernels
from fusedserve.kernels import fp8
from fusedserve.kernels.registry import REFERENCE_BACKEND
from fusedserve.model.config import UnsupportedModel
from fusedserve.model.family import Family
from fusedserve.model.packing import FEW_TOKEN_OPS, FUSED_LAYER_TOKENS, resolve_attention

log = logging.getLogger("fusedserve.model")

PRECISIONS = ("native", "fp8")  # the GEMMs in the model's dtype, or in FP8 with the rest in it (kernels.fp8)


class KernelPath:
    """The path of `encoder` (and a head calling `head_ops`) at one device, dtype and layout. `graphs` (the
    forwards' CUDA graphs, or None) is retargeted on every install: a graph replays the kernels it was captured
    with."""

    def __init__(self, encoder: torch.nn.Module, family: Family, device: torch.device, dtype: torch.dtype, *,
                 name: str, layout: str = "packed", attention: str = "auto", head_ops: tuple[str, ...] = (),
                 backend: str = "auto", backend_overrides: dict[str, str] | None = None,
                 precision: str = "native") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.encoder, self.family, self.name = encoder, family, name
        self.device, self.dtype, self.layout = device, dtype, layout
        self.head_ops = tuple(head_ops)
        self.backend, self.backend_overrides = backend, dict(backend_overrides or {})
        self.graphs = None
        # packed batches only: auto = the few-token layer + varlen flash attention in fp16/bf16 on CUDA (varlen alone
        # while the few-token ops are on the reference: attention_for), one SDPA per sequence on the CPU, else
        # pad-for-SDPA
        self.requested_attention = attention if layout == "packed" else "pad"
        self.attention, self.attention_reason = self.attention_for(None)
        self.selection = kernels.reference_selection(device, (dtype,), "not selected yet")
        self.fallback: str | None = None  # why the path fell back to the reference (fall_back), until set_fused
        self.reference = kernels.reference_selection(device, (dtype,), "reference re-run")
        # the precision asked for, and why it fell back to the fp16 (native) path: the verifier's sustained FP8
        # mismatches (fall_back_precision), until set_fused
        self.precision, self.precision_fallback = precision, None
        self.fp8_bytes = self._enable_fp8() if precision == "fp8" else 0

    def _enable_fp8(self) -> int:
        """Check that this model can run PRECISION=fp8 here (raises UnsupportedModel naming what cannot), run the
        FP8 ops' self-test and quantize the GEMM weights; returns their bytes."""
        refused = fp8.unavailable(self.device)
        if refused is None and not self.family.fp8:
            refused = (f"{self.family.label} models have no FP8 path (BERT, RoBERTa / XLM-RoBERTa, DistilBERT and "
                       "MPNet do)")
        if refused is None and self.layout != "packed":
            refused = "the padded layout (the tests' oracle) has no FP8 path"
        if refused is None:
            config = self.encoder.config
            try:
                fp8.self_test(self.device, self.dtype, (config.hidden_size, config.intermediate_size))
                return self.encoder.quantize_fp8()
            except fp8.Fp8Unavailable as exc:
                refused = str(exc)
        raise UnsupportedModel(f"PRECISION=fp8 cannot serve {self.name}: {refused}")

    @property
    def fused(self) -> bool:
        """The fused path is on and has not fallen back."""
        return self.selection.fused and self.fallback is None

    @property
    def label(self) -> str:
        """"fused" while any op the model calls runs on a fused backend, else "reference"."""
        return "fused" if self.selection.any_fused else "reference"

    @property
    def active_precision(self) -> str:
        """"fp8" while the GEMMs run in FP8 (asked for, not fallen back, the fused path on), else "native"."""
        return self.encoder.precision if self.family.fp8 else "native"

    # ---- the switches: changed only through these, between forwards ----------------------------------------------
    def set_fused(self, enabled: bool) -> kernels.Selection:
        """Select a backend per op (kernels.select) for the ops this model's forward calls, at its device, dtype and
        width, and use it; enabled=False puts every op on the reference. Clears a fallback. Under CUDA graphs only
        the kernels' device time counts in the race; launched eagerly, host cost counts too. With auto attention on
        a GPU the few-token layer is kept only while its ops run on a fused backend (see attention_for)."""
        def select(ops) -> kernels.Selection:
            return kernels.select(self.device, (self.dtype,), backend=self.backend, overrides=self.backend_overrides,
                                  fused=enabled, hidden_sizes=(self.encoder.config.hidden_size,),
                                  race_timing="device" if self.graphs is not None else "eager", ops=ops)

        attention, _ = self.attention_for(None)
        if self.requested_attention == "auto" and attention == "fused":
            # the few-token ops first, alone (Triton-only: no race; their self-test verdicts are cached for the
            # select below), so a fallback to varlen does not race the other ops twice
            attention, _ = self.attention_for(select(FEW_TOKEN_OPS))
        # may raise: nothing changed
        ops = self.family.kernel_ops(self.layout, attention, self.device, self.dtype) + self.head_ops
        selection = select(ops)
        self.fallback = self.precision_fallback = None
        return self._install(selection)

    def fall_back(self, op: str, reason: str) -> kernels.Selection:
        """Run `op` ("all": every op the model calls) on the torch reference from the next forward on, the same
        way the fused switch does: attention follows (attention_for), CUDA graphs are re-captured, and the
        selection (so /info and the kernel-timing labels) says so with the reason."""
        ops = list(self.selection.used) if op == "all" else [op]
        self.fallback = reason
        return self._install(self.selection.on_reference(ops, f"fallback: {reason}"))

    def fall_back_precision(self, reason: str) -> bool:
        """PRECISION=fp8's fallback tier: from the next forward on the GEMMs run in the model's dtype (its fp16 fused
        path, the kernels as selected), CUDA graphs re-captured; False where FP8 was not running."""
        if self.active_precision != "fp8":
            return False
        self.precision_fallback = reason
        self._install(self.selection)
        return True

    def use(self, selection: kernels.Selection) -> kernels.Selection:
        """Run on `selection` from the next forward on: one derived from this path's own (Selection.on_reference,
        Selection.with_impl: how the tests inject faults)."""
        if selection.device != self.device or self.dtype not in selection.dtypes:
            raise ValueError(f"a selection for {selection.device} {selection.dtypes} cannot run this model "
                             f"({self.device}, {self.dtype})")
        return self._install(selection)

    def _install(self, selection: kernels.Selection) -> kernels.Selection:
        self.selection = selection
        self.attention, self.attention_reason = self.attention_for(selection)
        if self.precision == "fp8":
            on = self.precision_fallback is None and selection.any_fused and self.fallback is None
            self.encoder.precision = "fp8" if on else "native"
        if self.graphs is not None:  # the graphs replay what was captured: a new selection, attention or precision
            self.graphs.attention = self.attention  # drops them
            self.graphs.set_fingerprint((selection.version, self.attention, self.active_precision))
        log.info("kernel selection %d, attention %s (%s)", selection.version, self.attention, self.attention_reason)
        return selection

    def attention_for(self, selection: kernels.Selection | None) -> tuple[str, str]:
        """The attention mode and why: the one place it is decided. From the requested mode, the device and dtype
        (model.packing.resolve_attention) and, given the ops' selection, auto's few-token layer only while its ops
        are on a fused backend (on the reference they are slower than varlen); None: before any selection."""
        attention = resolve_attention(self.requested_attention, self.device, self.dtype)
        if self.requested_attention != "auto":
            return attention, "as configured" if self.layout == "packed" else "padded layout"
        if attention == "varlen":
            return attention, "auto: one attention per sequence on the CPU"
        if attention != "fused":
            return attention, "auto: varlen attention needs fp16/bf16 on CUDA"
        if not self.family.few_token_layer:
            return "varlen", f"auto: varlen ({self.family.label} layers have no few-token layer)"
        on_reference = [op for op in FEW_TOKEN_OPS
                        if selection is not None and selection.backend_of(op) == REFERENCE_BACKEND]
        if on_reference:
            return "varlen", (f"auto: varlen, since the few-token layer's {', '.join(on_reference)} would run on "
                              f"the reference (slower than varlen)")
        return attention, f"auto: the few-token layer for batches of <= {FUSED_LAYER_TOKENS} tokens, varlen above"

"""What a loaded model says of itself: its head in words (the load report's line), the one-line shape of its forward
(layout, attention, CUDA graphs, FP8), and its kernel state for /info and the fused switch's answer. Reads an
Embedder (model.runner) and changes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusedserve import kernels
from fusedserve.model.packing import FUSED_LAYER_TOKENS

if TYPE_CHECKING:
    from fusedserve.model.runner import Embedder


def head_line(e: Embedder) -> str:
    """"head: ..." : what follows the encoder (a classifier, a yes/no reranker, SPLADE, or pooling and its modules)."""
    if e.classifier is not None:
        c = e.classifier
        if c.template is not None:
            return (f"head: {e.family.label} yes/no reranker (its prompt template; the LM head's rows "
                    f"{c.template.yes!r} and {c.template.no!r} at the last token), scores through sigmoid")
        return (f"head: {e.family.label} sequence classifier, {len(c.labels)} label(s) {', '.join(c.labels)}, scores "
                f"through {c.activation}")
    p = e.pipeline
    if p.colbert is not None:
        c, t = p.colbert, e.colbert
        expansion = ("expanded with the mask token, " + ("attended" if t.attend_expansion else "not attended")) \
            if t.expansion else "not expanded"
        return (f"head: ColBERT ({p.source}), Dense {' -> '.join(str(d.weight.shape[0]) for d in c.dense)}, a "
                f"normalized vector per token, dim {e.dim}; queries {c.query_prefix!r} up to {c.query_length} tokens "
                f"({expansion}), documents {c.document_prefix!r} up to {c.document_length} tokens, "
                f"{len(t.skiplist)} skiplist ids")
    if p.sparse is not None:
        return (f"head: SPLADE sparse vectors ({p.source}: masked-LM logits, log(1 + {p.sparse.activation}), max "
                f"over the tokens), dim {e.dim}")
    dense = f", Dense {' -> '.join(str(d.weight.shape[0]) for d in p.dense)}" if p.dense else ""
    prompts = f", prompts {', '.join(p.prompts)}" if p.prompts else ""
    return (f"head: {' + '.join(p.pooling)} pooling ({p.source}){dense}, dim {e.dim}, normalize "
            f"{'on' if p.normalize else 'off'}{prompts}")


def path_line(e: Embedder) -> str:
    """One line on the forward's shape: layout, attention and why, CUDA graphs (and Triton PDL on a GPU), FP8."""
    path, graphs = e.kernel_path, e.graphs
    if graphs is None:
        shown = "CUDA graphs off"
    else:
        shown = f"CUDA graphs on (up to {graphs.max_graphs} held, {len(graphs.graphs)} captured)"
    if e.device.type == "cuda" and "triton" in path.selection.used.values():
        shown += f", Triton programmatic dependent launch {'on' if kernels.pdl_enabled(e.device) else 'off'}"
    line = f"layout {e.layout}, attention {path.attention} ({path.attention_reason}), {shown}"
    if path.precision == "fp8":
        which = f"batches above {FUSED_LAYER_TOKENS} tokens" if path.attention == "fused" else "every batch"
        line += (f", FP8 GEMMs for {which} ({path.fp8_bytes / 2**20:.1f} MiB of E4M3 weights)"
                 if path.active_precision == "fp8" else
                 f", FP8 GEMMs off ({path.precision_fallback or 'the fused path is off'})")
    return line


def state(e: Embedder) -> dict:
    """The model's kernel state for /info and the fused switch's answer."""
    path = e.kernel_path
    return {
        "kind": e.kind,
        "architecture": e.family.name,
        "dim": e.dim,
        "head": head_line(e).removeprefix("head: "),
        **({"labels": list(e.classifier.labels)} if e.classifier is not None else {}),
        **({"prompts": dict(e.pipeline.prompts)} if e.pipeline is not None and e.pipeline.prompts else {}),
        "fused": path.fused,
        "fallback": path.fallback,
        "precision": {"requested": path.precision, "active": path.active_precision,
                      "fallback": path.precision_fallback},
        "selection_version": path.selection.version,
        "kernels": path.selection.as_dict()["ops"],
        "layout": e.layout,
        "attention": path.attention,
        "attention_reason": path.attention_reason,
        "cuda_graphs": e.graphs.stats() if e.graphs is not None else {"enabled": False},
        # the CUDA backend's tuned launch configurations so far (kernel|dtype|width|row bucket -> config)
        "cuda_launch_configs": kernels.cuda_launch_configs() if "cuda" in path.selection.used.values() else {},
    }

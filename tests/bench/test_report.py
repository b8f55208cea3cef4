"""`python -m bench report`: markdown tables naming their source, and the docs' plots, from results files (made
here by the suites' own writer, not read from the committed history)."""

from __future__ import annotations

import pytest

from bench import report
from bench import results as store
from bench.__main__ import main



def _write(directory, suite, scenario, rows, summary=None, settings=None):
    head = store.header("cpu", [suite, scenario])
    store.write(directory / f"{suite}.json", suite, "cpu", scenario,
                store.block(head, settings or {"per_request": 16}, rows, summary or {}))


def _server():
    return {"cpu_ms_per_request": 1.5}


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "cpu"
    _write(d, "kernels", "fused-ops", [
        {"op": op, "dtype": "float16", "shape": shape, "provider": p, "us": us, "gbps": 100 / us, "pct_copy": 10.0,
         "bytes": 1e6} for op in ("layer_norm", "bias_gelu") for shape in ("8x64", "16x64")
        for p, us in (("triton", 1.0), ("eager", 2.0), ("compile", 1.5))], {"copy_gbps": 500.0})
    for case in ("minilm-b1-s16", "minilm-b32-s128"):
        _write(d, "encoder", case, [
            {"provider": "torch eager", "ms": 2.0, "tokens": 16, "padded_tokens": 16, "gemm_floor_ms": 0.01},
            {"provider": "ours", "backend": "auto", "mode": "graphs", "ms": 0.2, "tokens": 16, "padded_tokens": 16},
            {"provider": "torch.compile", "error": "RuntimeError: no"}])
    _write(d, "serve", "closed-loop", [
        {"payload": p, "clients": c, "requests_per_s": 10.0 * c, "tokens_per_s": 1e6 * c, "served_vs_raw": c / 100,
         "vs_sentence_transformers": 3.0, "p50_ms": c / 2, "p99_ms": c, "server": _server()}
        for p in ("text", "ids") for c in (16, 64)],
        {"runner_raw_tokens_per_s": 1e8, "sentence_transformers_tokens_per_s": 2e7})
    _write(d, "serve", "replicas", [
        {"replicas": n, "clients": 64, "requests_per_s": 100.0 * n, "tokens_per_s": 1e6 * n,
         "served_vs_raw": n / 8, "p50_ms": 1.0, "p99_ms": 2.0, "server": _server()} for n in (4, 6)], {"mps": True})
    _write(d, "serve", "workers", [
        {"workers": n, "payload": p, "clients": 64, "requests_per_s": 100.0 * n, "tokens_per_s": 1e6 * n,
         "served_vs_raw": n / 8, "vs_sentence_transformers": 2.0 * n, "p50_ms": 1.0, "p99_ms": 2.0,
         "server": _server()} for n in (2, 4) for p in ("text", "ids")], {"mps": False})
    return d


def test_tables_name_their_source_and_hold_the_numbers(results_dir):
    text = report.tables(results_dir / "encoder.json")
    assert "scenario `minilm-b1-s16`" in text and "python -m bench encoder minilm-b1-s16" in text
    assert "| ours, CUDA graphs | 0.200 | 0.200 |" in text and "| torch.compile | failed | failed |" in text
    kernels = report.tables(results_dir / "kernels.json")
    assert "| layer_norm | float16 | 8x64 | 1 | 1.0 | 100 | 10% | 2.0 | 1.5 | 1.50x |" in kernels
    assert "over 4 cells: geometric mean 1.50x (float16 1.50x); 0 cells under 1.00x." in kernels
    serve = report.tables(results_dir / "serve.json")
    assert "| ids | 64 | 640 | 64.00 | 64% | 3.0x | 32.0 / 64.0 | 1.50 |" in serve
    assert "| 6 | ids | 64 | 600 | 6.00 | 75% | - |" in serve  # replicas without a sentence-transformers rate
    assert "| 4 | text | 64 | 400 | 4.00 | 50% | 8.0x | 1.0 / 2.0 | 1.50 |" in serve


def test_fused_ops_summary_counts_the_acceptance_figures():
    """The faster backend per cell against compile, and the large cells against both copy ceilings."""
    def cell(shape, mb, triton_us, cuda_us, compile_us, pct_copy, pct_same):
        common = {"op": "layer_norm", "dtype": "bfloat16", "shape": shape, "bytes": mb * 1e6}
        fused = {"pct_copy": pct_copy, "pct_same_bytes_copy": pct_same}
        return [{**common, "provider": "triton", "us": triton_us, **fused},
                {**common, "provider": "cuda", "us": cuda_us, **fused},
                {**common, "provider": "compile", "us": compile_us}]

    block = {"summary": {"copy_gbps": 4000.0},
             "results": cell("1x1", 30, 2.0, 1.0, 2.0, 86, 95) + cell("2x2", 100, 4.0, 5.0, 2.0, 50, 80)
             + cell("3x3", 10, 1.0, 1.0, 1.0, 20, 60)}
    text = report.fused_ops_summary(block)
    # cell 1: cuda (1.0) is the faster backend, 2.0x; cell 2: triton, 0.5x; cell 3: 1.0x
    assert "over 3 cells: geometric mean 1.00x (bfloat16 1.00x); 1 cells under 1.00x (0.500x to 0.500x: " \
           "layer_norm bfloat16 2x2)." in text
    assert "Of the 2 cells of 25 MB or more, 1 reach 85% of the 1 GiB copy (4000 GB/s)." in text
    assert "reach 80-95% (median 88%); 1 of 2 reach 90%." in text


def test_plots_from_a_results_directory(results_dir, tmp_path):
    images = tmp_path / "img"
    assert main(["report", str(results_dir / "serve.json"), "--plots-from", str(results_dir),
                 "--images", str(images)]) == 0
    for name in report.PLOTS:
        png = images / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name


def test_two_encoder_runs_compared_row_by_row(tmp_path, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    _write(before, "encoder", "minilm-b1-s16", [
        {"provider": "ours", "backend": "auto", "mode": "graphs", "ms": 0.25, "tokens": 16, "padded_tokens": 16},
        {"provider": "ours", "backend": "auto", "mode": "eager", "ms": 2.0, "tokens": 16, "padded_tokens": 16}])
    _write(after, "encoder", "minilm-b1-s16", [
        {"provider": "ours", "backend": "auto", "mode": "graphs", "ms": 0.2, "tokens": 16, "padded_tokens": 16},
        {"provider": "ours", "backend": "cuda", "mode": "graphs", "ms": 0.3, "tokens": 16, "padded_tokens": 16},
        {"provider": "ours", "backend": "triton", "mode": "graphs", "error": "RuntimeError: no"}])
    assert main(["report", "--no-plots", "--compare", str(before / "encoder.json"), str(after / "encoder.json")]) == 0
    text = capsys.readouterr().out
    assert "| case | row | before ms | after ms | after / before |" in text
    assert "| minilm-b1-s16 | ours, CUDA graphs | 0.250 | 0.200 | 0.800x |" in text
    assert "| minilm-b1-s16 | ours, eager | 2.000 | - | - |" in text  # a row of one run only
    assert "| minilm-b1-s16 | ours cuda, CUDA graphs | - | 0.300 | - |" in text
    assert "ours triton" not in text  # a failed row has no time to compare
    assert text.count("scenario `minilm-b1-s16`") == 2  # each run's source
    with pytest.raises(SystemExit):
        main(["report", "--no-plots", "--compare", str(before / "encoder.json"), str(tmp_path / "none.json")])


def test_openai_load_table(tmp_path):
    from bench import openai_load

    def row(tree, start, rate, p50):
        return {"tree": tree, "start": start, "point": "64x1", "clients": 64, "per_request": 1, "requests": 100,
                "errors": 0, "seconds": 8.0, "requests_per_s": rate, "texts_per_s": rate, "tokens_per_s": 50 * rate,
                "p50_ms": p50, "p99_ms": 2 * p50, "client_cpu_share": 0.31, "server_cpu_cores": rate / 1000}

    rows = [row("baseline", 0, 1000.0, 40.0), row("current", 0, 950.0, 42.0)]
    per_tree = openai_load.medians(rows)
    summary = {"medians": per_tree, "comparison": openai_load.comparison(per_tree, 0.03, 0.1)}
    _write(tmp_path, "serve", "openai-load", rows, summary)
    text = report.tables(tmp_path / "serve.json")
    assert "| baseline | 64x1 | 1 | 1000 | 1000 | 50.0 | 40.00 / 80.0 | 0 | 31% | 1.00 | - |" in text
    assert "| current | 64x1 | 1 | 950 | 950 | 47.5 | 42.00 / 84.0 | 0 | 31% | 0.95 | x0.950, x0.950, +2.000 ms " \
           "**out of bounds** |" in text


def test_a_variant_run_renders_as_its_scenario_with_its_reference_checks(tmp_path):
    """`bench serve openai-load --as openai-load-fp8` is stored under its own name and renders as openai-load does;
    a run with the online reference check on says what the checks found; a name no table knows renders nothing."""
    from bench import openai_load

    rows = [{"tree": "current", "start": 0, "point": p, "clients": 64, "per_request": 1, "requests": 100,
             "errors": 0, "seconds": 8.0, "requests_per_s": 900.0, "texts_per_s": 900.0, "tokens_per_s": 9e4,
             "p50_ms": 20.0, "p99_ms": 30.0, "client_cpu_share": 0.05, "server_cpu_cores": 2.0,
             "reference_checks": {"match": m, "mismatch": 1.0, "error": 0.0, "dropped": 2.0}}
            for p, m in (("64x1", 570.0), ("64x16", 612.0))]
    _write(tmp_path, "serve", "openai-load-fp8", rows, {"medians": openai_load.medians(rows)})
    _write(tmp_path, "serve", "openaiload", rows, {"medians": openai_load.medians(rows)})
    text = report.tables(tmp_path / "serve.json")
    assert "scenario `openai-load-fp8`" in text and "| current | 64x16 | 1 | 900 |" in text
    assert "Reference checks over the run: 1,182 matched, 2 mismatched, 0 failed, 4 dropped." in text
    assert "scenario `openaiload`" not in text

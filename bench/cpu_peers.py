"""The serving suite's `cpu` scenario: the question a CPU user asks first. Is the server, on the same cores as its
load client, faster than calling sentence-transformers in-process? Same texts, same run, --rounds rounds alternating
between each server configuration and every peer (ours, then each peer, in turn); per row the median of the rounds,
their min and max, and the CPU time a text costs.

Peers: `SentenceTransformer.encode(batch_size=32)` in fp32 in this process; its ONNX backend, in this process, where
onnxruntime (and what sentence-transformers needs to export the model) imports; its OpenVINO backend (openvino and
optimum-intel, OPENVINO_REQUIREMENTS) in its default configuration and with the f32 inference-precision hint, in a
process of its own venv: optimum-intel pins transformers, huggingface-hub and tokenizers below the project's, so the
bench makes that venv itself (--openvino-venv: those packages, the project venv's site-packages behind them for
torch and sentence-transformers) and talks to it through `python -m bench.cpu_peers worker`. A peer's CPU time is
its process's around `encode`; the server's, its process tree's over the closed loop (/proc). A peer that cannot run
is recorded with the reason.

Per server configuration (fp32 with the defaults, the bfloat16 path where the CPU has instructions for it,
WORKERS=2): its time to ready, then per round closed-loop load from --cpu-clients clients of --per-request texts on
keep-alive connections (the client's own CPU time reported beside), then one text at a time (p50 / p99) against
sentence-transformers encoding one text at a time, and the lowest cosine to sentence-transformers (fp32, torch) over
held-out texts, for the server and every peer."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx

from bench.harness import (kept_log, load, log_path, min_cosine, mixed_texts, percentiles_ms, running_servers,
                           server_settings)

CONFIGS = {"fp32": {}, "bfloat16": {"dtype": "bfloat16"}, "workers-2": {"workers": "2"}}
HELD_OUT = 32  # texts each configuration's and peer's vectors are checked on
REPO = Path(__file__).resolve().parent.parent
REFERENCE = "sentence-transformers"  # the torch fp32 peer: the rate and the vectors the others are held against
# the OpenVINO peer's packages, in its own venv (installing them here would move transformers, huggingface-hub and
# tokenizers down to optimum-intel's bounds)
OPENVINO_REQUIREMENTS = ("openvino==2026.4.1", "optimum-intel[openvino]==2.2.0")
# the OpenVINO rows: sentence-transformers' model_kwargs for each (ov_config goes to openvino's compile_model as is)
OPENVINO_PEERS = {"sentence-transformers openvino": {},
                  "sentence-transformers openvino f32": {"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}}
# what the OpenVINO peer's compiled model resolved them to, recorded beside its numbers
OPENVINO_PROPERTIES = ("INFERENCE_PRECISION_HINT", "PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS",
                       "EXECUTION_MODE_HINT")
VENV_MARKER = "fusedserve-peer.json"  # written into a venv the bench made, with what it installed there


def _default_openvino_venv() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("FUSEDSERVE_OPENVINO_VENV") or os.path.join(cache, "fusedserve", "openvino-peer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="cpu: the server configurations (bfloat16 is skipped, saying why, on a CPU without "
                             "its instructions)")
    parser.add_argument("--cpu-clients", type=int, default=4, help="cpu: keep-alive clients of the closed loop")
    parser.add_argument("--rounds", type=int, default=3, help="cpu: rounds alternating the server and the peers")
    parser.add_argument("--one-text-count", type=int, default=50, help="cpu: single texts timed one at a time")
    parser.add_argument("--openvino-venv", default=_default_openvino_venv(),
                        help="cpu: the OpenVINO peer's own venv, made there (and reused) by the bench; default "
                             "$FUSEDSERVE_OPENVINO_VENV or ~/.cache/fusedserve/openvino-peer")
    parser.add_argument("--openvino-python",
                        help="cpu: run the OpenVINO peer with this interpreter instead (one that imports openvino, "
                             "optimum-intel and sentence-transformers); nothing is installed")
    parser.add_argument("--no-openvino", dest="openvino", action="store_false",
                        help="cpu: leave the OpenVINO peer out (its rows say so)")


def settings(args: argparse.Namespace) -> dict:
    return {"configs": args.cpu_configs, "clients": args.cpu_clients, "rounds": args.rounds,
            "peer_batch_size": 32, "openvino": {"requirements": list(OPENVINO_REQUIREMENTS),
                                                 "peers": OPENVINO_PEERS, "run": args.openvino}}


def _model_dir(args: argparse.Namespace) -> Path:
    from fusedserve.model.config import PRESETS
    from fusedserve.model.weights import default_model_dir

    if args.model in PRESETS:
        raise SystemExit("cpu: sentence-transformers loads a checkpoint directory; a preset (random init) has none")
    return default_model_dir() if args.model == "default" else Path(args.model).resolve()


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip()[:300]}"


# ---- the peers --------------------------------------------------------------------------------------------------
def _timed_encode(model, texts: list[str]) -> dict:
    """One pass of `encode` over `texts`: wall seconds and this process's CPU seconds (every thread's)."""
    cpu, started = time.process_time(), time.perf_counter()
    model.encode(texts, batch_size=32)
    return {"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


def _versions(names: tuple[str, ...]) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


class InProcessPeer:
    """A SentenceTransformer in this process."""

    def __init__(self, model, texts: list[str], backend: str, load_s: float) -> None:
        self.model, self.texts = model, texts
        self.about = {"backend": backend, "process": "in-process", "model_kwargs": {}, "load_s": load_s}

    def rate(self) -> dict:
        return _timed_encode(self.model, self.texts)

    def vectors(self, texts: list[str]) -> list[list[float]]:
        return self.model.encode(texts, batch_size=32).tolist()

    def warm(self, texts: list[str]) -> None:
        self.model.encode(texts, batch_size=32)


class PeerProcess:
    """`python -m bench.cpu_peers worker` under another interpreter (the OpenVINO peer's venv): SentenceTransformer
    models held there, one JSON command a line to its stdin, one JSON answer a line back."""

    def __init__(self, python: str, log: str) -> None:
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        env.pop("TRITON_INTERPRET", None)
        with open(log, "a") as handle:
            self.process = subprocess.Popen([python, "-m", "bench.cpu_peers", "worker"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=handle, cwd=REPO, env=env, text=True)

    def call(self, **command) -> dict:
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except OSError:  # its end of the pipe closed: it ended
            line = ""
        if not line:
            tail = Path(self.log).read_text(errors="replace")[-1500:] if self.log != os.devnull else ""
            raise RuntimeError(f"the peer process ended (exit code {self.process.poll()}); its log ends: {tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def close(self) -> None:
        """End of its stdin: the worker returns; killed if it has not within a minute."""
        try:
            self.process.stdin.close()
        except OSError:  # it had ended: nothing to flush to
            pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


class ProcessPeer:
    """One model of a PeerProcess (which holds the corpus)."""

    def __init__(self, process: PeerProcess, name: str, about: dict) -> None:
        self.process, self.name, self.about = process, name, about

    def rate(self) -> dict:
        return self.process.call(op="rate", name=self.name)

    def vectors(self, texts: list[str]) -> list[list[float]]:
        return self.process.call(op="encode", name=self.name, texts=texts, vectors=True)["vectors"]

    def warm(self, texts: list[str]) -> None:
        self.process.call(op="encode", name=self.name, texts=texts, vectors=False)


def _worker() -> None:
    """The far end of PeerProcess. The libraries' own prints go to stderr (fd 1 is pointed there); the answers to the
    original stdout."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    models: dict = {}
    corpus: list[str] = []
    for line in sys.stdin:
        command = json.loads(line)
        try:
            op = command["op"]
            if op == "texts":
                corpus[:] = command["texts"]
                answer: dict = {"texts": len(corpus)}
            elif op == "load":
                from sentence_transformers import SentenceTransformer

                started = time.perf_counter()
                model = SentenceTransformer(command["path"], device="cpu", backend=command["backend"],
                                            model_kwargs=command["model_kwargs"] or None)
                models[command["name"]] = model
                answer = {"load_s": time.perf_counter() - started, "properties": _compiled_properties(model),
                          "versions": _versions(("openvino", "optimum-intel", "optimum", "sentence-transformers",
                                                 "transformers", "huggingface-hub", "tokenizers", "torch")),
                          "python": sys.executable}
            elif op == "encode":
                vectors = models[command["name"]].encode(command["texts"], batch_size=32)
                answer = {"vectors": vectors.tolist() if command["vectors"] else None}
            elif op == "rate":
                answer = _timed_encode(models[command["name"]], corpus)
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as error:  # noqa: BLE001 - any failure is the peer's, answered with its reason
            answer = {"error": _reason(error)}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def _compiled_properties(model) -> dict[str, str]:
    """What an OpenVINO model's compiled form resolved OPENVINO_PROPERTIES to (empty for another backend)."""
    request = getattr(model[0].auto_model, "request", None)
    if request is None or not hasattr(request, "get_property"):
        return {}
    out = {}
    for name in OPENVINO_PROPERTIES:
        try:
            value = request.get_property(name)
        except Exception:  # noqa: BLE001 - a property this plugin does not have
            continue
        out[name] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)  # ov.Type: "f32"
    return out


def openvino_python(args: argparse.Namespace, log: str) -> str:
    """The interpreter of the OpenVINO peer: --openvino-python, else --openvino-venv's, made there when missing (a
    venv of this interpreter, OPENVINO_REQUIREMENTS installed into it by pip, this venv's site-packages behind its
    own). Raises RuntimeError with the reason it cannot be had."""
    if args.openvino_python:
        if not shutil.which(args.openvino_python):
            raise RuntimeError(f"--openvino-python {args.openvino_python}: no such interpreter")
        return args.openvino_python
    venv = Path(args.openvino_venv).expanduser()
    python, marker = venv / "bin" / "python", venv / VENV_MARKER
    wanted = [*OPENVINO_REQUIREMENTS, f"sentence-transformers=={importlib.metadata.version('sentence-transformers')}"]
    if importlib.util.find_spec("datasets") is not None:
        # sentence-transformers imports datasets where it is installed; this venv's may need a newer huggingface-hub
        # than optimum-intel allows, so pip picks one for that venv beside the others
        wanted.append("datasets")
    if python.exists() and marker.is_file() and json.loads(marker.read_text()).get("requirements") == wanted:
        return str(python)
    if venv.exists():
        if not marker.is_file() and any(venv.iterdir()):
            raise RuntimeError(f"{venv} exists and is not a venv the bench made (no {VENV_MARKER}): pass another "
                               "--openvino-venv")
        shutil.rmtree(venv)
    print(f"[cpu] making the OpenVINO peer's venv {venv}: {' '.join(wanted)}", file=sys.stderr, flush=True)
    with open(log, "a") as handle:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=handle, stderr=handle)
        marker.write_text(json.dumps({"requirements": None}) + "\n")  # the bench's, to be remade if cut short
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # the project venv's site-packages behind the new venv's own: torch, sentence-transformers and the rest
        # come from the project's, what pip puts in the new one (transformers, huggingface-hub, tokenizers at
        # optimum-intel's bounds) before them
        parents = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
        Path(site, "_fusedserve_project_venv.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
        installed = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *wanted],
                                   stdout=handle, stderr=handle, timeout=1800)
    if installed.returncode:
        raise RuntimeError(f"pip install {' '.join(wanted)} into {venv} failed ({installed.returncode}); see {log}")
    marker.write_text(json.dumps({"requirements": wanted, "project_site_packages": list(parents)}, indent=1) + "\n")
    return str(python)


def _peers(args: argparse.Namespace, path: Path, texts: list[str], unavailable: dict
           ) -> tuple[dict, PeerProcess | None]:
    """({name: peer} of the peers that load, the OpenVINO peer's process or None); each peer that cannot run goes
    into `unavailable` with the reason."""
    from sentence_transformers import SentenceTransformer

    def in_process(backend: str) -> InProcessPeer:
        started = time.perf_counter()
        model = SentenceTransformer(str(path), device="cpu", backend=backend)
        return InProcessPeer(model, texts, backend, time.perf_counter() - started)

    peers: dict = {REFERENCE: in_process("torch")}
    onnx = "sentence-transformers onnx"
    if importlib.util.find_spec("onnxruntime") is None:
        unavailable[onnx] = "onnxruntime is not installed (pip install 'fusedserve[bench]')"
    else:
        try:
            peers[onnx] = in_process("onnx")
        except Exception as error:  # noqa: BLE001 - any failure to export or load is the peer's, recorded
            unavailable[onnx] = _reason(error)
    if not args.openvino:
        unavailable.update(dict.fromkeys(OPENVINO_PEERS, "not run (--no-openvino)"))
        return peers, None
    log = kept_log(args, "cpu-openvino")
    try:
        process = PeerProcess(openvino_python(args, log), log)
        process.call(op="texts", texts=texts)
    except Exception as error:  # noqa: BLE001 - no venv, no interpreter, a process that does not start
        unavailable.update(dict.fromkeys(OPENVINO_PEERS, f"OpenVINO peer: {_reason(error)}"))
        return peers, None
    for name, model_kwargs in OPENVINO_PEERS.items():
        try:
            about = process.call(op="load", name=name, path=str(path), backend="openvino", model_kwargs=model_kwargs)
            peers[name] = ProcessPeer(process, name, {"backend": "openvino", "process": "own venv",
                                                      "model_kwargs": model_kwargs, **about})
        except Exception as error:  # noqa: BLE001 - recorded as the row's reason
            unavailable[name] = _reason(error)
    return peers, process


# ---- our server -------------------------------------------------------------------------------------------------
def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and its descendants, with the children each has reaped: a server
    and its workers (/proc)."""
    ticks, total, stack = os.sysconf("SC_CLK_TCK"), 0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rpartition(")")[2].split()
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
            for task in Path(f"/proc/{current}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue  # ended meanwhile
    return total / ticks


def _one_text_ms(encode, texts: list[str]) -> dict:
    latencies = []
    for text in texts:
        started = time.perf_counter()
        encode(text)
        latencies.append(time.perf_counter() - started)
    return percentiles_ms(latencies)


def _served_vectors(client: httpx.Client, texts: list[str], model: str) -> list[list[float]]:
    r = client.post("/v1/embeddings", json={"input": texts, "model": model})
    r.raise_for_status()
    return [row["embedding"] for row in r.json()["data"]]


def _closed_loop(url: str, pid: int, texts: list[str], args: argparse.Namespace) -> dict:
    """One closed-loop point from this process (one event loop: the load client), with its CPU time and the server's
    (process `pid` and its workers)."""
    cpu, server_cpu = time.process_time(), _tree_cpu_s(pid)
    run = load(url, texts, args.cpu_clients, args.seconds, args.per_request, payload="openai")
    server_cpu, client_cpu = _tree_cpu_s(pid) - server_cpu, time.process_time() - cpu
    texts_done = len(run["latencies"]) * args.per_request
    return {"texts_per_s": texts_done / run["elapsed"], "requests": len(run["latencies"]), "errors": run["errors"],
            "seconds": run["elapsed"], "texts": texts_done, "server_cpu_s": server_cpu, "client_cpu_s": client_cpu,
            "cpu_ms_per_text": 1e3 * server_cpu / texts_done if texts_done else None,
            **percentiles_ms(run["latencies"])}


def _supported(config: str) -> str | None:
    """Why a configuration cannot run on this machine, or None."""
    if config == "bfloat16":
        import torch

        from fusedserve.model.loading import CPU_HALF_FLAGS, cpu_flags, cpu_half_isa

        if not cpu_half_isa(torch.bfloat16):
            simd = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
            return (f"not measurable on this CPU: /proc/cpuinfo flags have none of "
                    f"{', '.join(CPU_HALF_FLAGS[torch.bfloat16])} (its vector flags: {', '.join(simd) or 'none'})")
    return None


def _spread(values: list[float], key: str) -> dict:
    """`key`: the median of `values`, `key`_min and `key`_max."""
    return {key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)}


def _peer_row(about: dict, rounds: list[dict], reference_rounds: list[dict], cosine: float) -> dict:
    rates = [r["texts_per_s"] for r in rounds]
    return {**about, **_spread(rates, "texts_per_s"), **_spread([r["cpu_ms_per_text"] for r in rounds],
                                                                "cpu_ms_per_text"),
            "vs_sentence_transformers": statistics.median(r["texts_per_s"] / s["texts_per_s"]
                                                          for r, s in zip(rounds, reference_rounds)),
            "min_cosine": cosine, "rounds": rounds}


def _table(rows: list[dict], summary: dict) -> str:
    """Every row of the run, ours and the peers', and the ones that could not run with the reason."""
    def spread(r: dict, key: str, digits: int) -> str:
        return f"{r[key]:.{digits}f} ({r[key + '_min']:.{digits}f}-{r[key + '_max']:.{digits}f})"

    lines = [f"{'row':<40} {'texts/s median (min-max)':>26} {'CPU ms/text median (min-max)':>30} {'x ST':>6} "
             f"{'min cosine':>10}"]
    shown = [(f"fusedserve {r['config']}", r) for r in rows]
    shown += [(name, r) for name, r in summary["peers"].items()]
    for name, r in shown:
        lines.append(f"{name:<40} {spread(r, 'texts_per_s', 1):>26} {spread(r, 'cpu_ms_per_text', 1):>30} "
                     f"{r['vs_sentence_transformers']:>5.2f}x {r['min_cosine']:>10.6f}")
    lines += [f"{name:<40} {reason}" for name, reason in summary["unavailable"].items()]
    return "\n".join(lines)


def cpu_scenario(args: argparse.Namespace, save) -> None:
    if args.device != "cpu":
        raise SystemExit("cpu: a scenario of the CPU device (--device cpu)")
    texts = mixed_texts(args.texts, low=min(5, args.max_words), high=args.max_words)
    held = mixed_texts(HELD_OUT, seed=1, low=min(5, args.max_words), high=args.max_words)
    singles = texts[: args.one_text_count]
    summary: dict = {"texts": len(texts), "held_out": len(held), "clients": args.cpu_clients,
                     "per_request": args.per_request, "rounds": args.rounds, "unavailable": {}, "peers": {}}
    peers, process = _peers(args, _model_dir(args), texts, summary["unavailable"])
    try:
        _run(args, save, peers, summary, texts, held, singles)
    finally:
        if process is not None:
            process.close()


def _run(args: argparse.Namespace, save, peers: dict, summary: dict, texts: list[str], held: list[str],
         singles: list[str]) -> None:
    st = peers[REFERENCE]
    reference = st.vectors(held)
    cosines = {}
    for name in list(peers):
        try:
            cosines[name] = min_cosine(peers[name].vectors(held), reference)
            peers[name].warm(texts[:64])
        except Exception as error:  # noqa: BLE001 - a peer that fails here has no row, only its reason
            if name == REFERENCE:
                raise
            summary["unavailable"][name] = _reason(error)
            del peers[name]
    summary["sentence_transformers_one_text"] = _one_text_ms(lambda t: st.model.encode([t]), singles)
    peer_rounds: dict[str, list[dict]] = {name: [] for name in peers}
    rows: list[dict] = []
    for config in args.cpu_configs:
        reason = _supported(config)
        if reason:
            summary["unavailable"][config] = reason
            print(f"[cpu] {config}: skipped ({reason})", file=sys.stderr, flush=True)
            continue
        settings = {**server_settings(args), **CONFIGS[config]}
        started = time.monotonic()
        with running_servers(1, log_path(args, f"cpu-{config}"), **settings) as servers:
            ready_s = time.monotonic() - started
            process, url = servers[0]
            with httpx.Client(base_url=url, timeout=60) as client:
                info = client.get("/info").json()
                cosine = min_cosine(_served_vectors(client, held, info["model"]), reference)
                load(url, texts[:64], args.cpu_clients, 2, args.per_request, payload="openai")  # warm
                points, ratios = [], []
                for round_index in range(args.rounds):
                    points.append(_closed_loop(url, process.pid, texts, args))
                    for name in list(peer_rounds):
                        try:
                            timed = peers[name].rate()
                        except Exception as error:  # noqa: BLE001 - the peer's rows stop; its reason says where
                            if name == REFERENCE:
                                raise
                            summary["unavailable"][name] = f"failed in a round of {config}: {_reason(error)}"
                            del peer_rounds[name], peers[name]
                            continue
                        peer_rounds[name].append({"texts_per_s": len(texts) / timed["seconds"],
                                                  "cpu_ms_per_text": 1e3 * timed["cpu_s"] / len(texts),
                                                  "config": config, **timed})
                    ratios.append(points[-1]["texts_per_s"] / peer_rounds[REFERENCE][-1]["texts_per_s"])
                one_text = _one_text_ms(lambda t: _served_vectors(client, [t], info["model"]), singles)
        middle = sorted(points, key=lambda p: p["texts_per_s"])[len(points) // 2]
        rows.append({"config": config, "dtype": info.get("dtype"), "cpu_isa": info.get("cpu_isa"),
                     "workers": info.get("worker", {}).get("workers"), "attention": info.get("attention"),
                     "ready_s": ready_s, **_spread([p["texts_per_s"] for p in points], "texts_per_s"),
                     **_spread([p["cpu_ms_per_text"] for p in points], "cpu_ms_per_text"),
                     "client_cpu_ms_per_text": statistics.median(1e3 * p["client_cpu_s"] / p["texts"]
                                                                 for p in points),
                     "vs_sentence_transformers": statistics.median(ratios), "rounds": points,
                     "client_cpu_share": middle["client_cpu_s"] / middle["seconds"],
                     "one_text": one_text, "min_cosine": cosine,
                     "errors": sum(p["errors"] for p in points)})
        r = rows[-1]
        print(f"[cpu] {config}: {r['texts_per_s']:.1f} texts/s, {r['cpu_ms_per_text']:.1f} server CPU ms/text, "
              f"{r['vs_sentence_transformers']:.2f}x sentence-transformers, one text p50 {one_text['p50_ms']:.1f} ms "
              f"(sentence-transformers {summary['sentence_transformers_one_text']['p50_ms']:.1f}), ready "
              f"{ready_s:.1f} s, min cosine {cosine:.6f}, client CPU {100 * r['client_cpu_share']:.0f}%",
              file=sys.stderr, flush=True)
        summary["peers"] = {name: _peer_row(peers[name].about, got, peer_rounds[REFERENCE], cosines[name])
                            for name, got in peer_rounds.items() if got}
        save(rows, summary, False)
    print(_table(rows, summary), file=sys.stderr, flush=True)
    save(rows, summary, True)


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()

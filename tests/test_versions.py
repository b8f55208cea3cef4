"""The libraries whose internals the product reaches into, checked for the shape it uses, so that a version outside
the tested range fails a test named for the library instead of serving wrong:

- starlette: `starlette._utils.get_route_path(scope)` (server/app.py's hot routes: the path a router matches, the
  root_path taken off);
- uvicorn: `HttpToolsProtocol`, subclassed by server/protocol.py (connection_made, on_message_begin,
  on_headers_complete, connection_lost; the server's shared `connections`, `loop`, `transport`, `scope`) and given
  to uvicorn.Config as the `http` class;
- triton: the autotuner (kernels/triton/_common.py, kernels/__init__.py): triton.autotune's `do_bench` and
  `prune_configs_by` (early_config_prune called with the configs and the launch's arguments by name), `do_bench` read
  through the instance so that an attribute shadows it (watch_autotunes), `run` reached through the instance, the
  chosen configs in `cache` under tuple keys that survive JSON (the shipped tuning tables), a Config's fields.

pyproject.toml bounds these libraries to the versions this suite has run on; the first test says whether the
installed ones are among them."""

from __future__ import annotations

import asyncio
import inspect
import json
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
REACHED_INTO = ("fastapi", "starlette", "uvicorn", "triton")


def _requirements() -> dict[str, Requirement]:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {(r := Requirement(line)).name: r for line in dependencies}


@pytest.mark.parametrize("name", REACHED_INTO)
def test_the_installed_version_is_in_the_tested_range(name):
    requirement = _requirements().get(name)
    assert requirement is not None, f"pyproject.toml does not name {name}, whose internals the product reaches into"
    bounds = {spec.operator[0] for spec in requirement.specifier}
    assert {">", "<"} <= bounds, f"{requirement}: a tested range has a lower and an upper bound"
    if requirement.marker is not None and not requirement.marker.evaluate():
        pytest.skip(f"{name} is not a dependency here ({requirement.marker})")
    try:
        installed = version(name)
    except PackageNotFoundError:
        pytest.skip(f"{name} not installed")
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is outside the tested range {requirement.specifier}: run this suite on it (the checks "
        "below name what the product uses), then widen the bound in pyproject.toml")


def test_starlette_get_route_path_takes_the_root_path_off():
    from starlette._utils import get_route_path

    assert list(inspect.signature(get_route_path).parameters) == ["scope"]
    assert get_route_path({"type": "http", "path": "/infer"}) == "/infer"
    assert get_route_path({"type": "http", "path": "/api/infer", "root_path": "/api"}) == "/infer"
    assert get_route_path({"type": "http", "path": "/infer", "root_path": "/api"}) == "/infer"


class _Transport(asyncio.Transport):
    """A connection's transport, without a socket: what HttpToolsProtocol reads and writes of it."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closing = bytearray(), False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_uvicorn_http_tools_protocol_is_what_the_header_deadline_extends():
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from fusedserve.server.protocol import OVER_CAPACITY, guarded

    for method in ("connection_made", "on_message_begin", "on_headers_complete", "connection_lost"):
        assert callable(getattr(HttpToolsProtocol, method, None)), f"HttpToolsProtocol.{method} is gone"
    scopes = []

    async def app(scope, receive, send):
        scopes.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def serve() -> None:
        protocol = guarded(timeout_s=10.0, max_connections=1)
        config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="warning")
        config.load()
        assert config.http_protocol_class is protocol  # the class given as `http` is the one uvicorn runs
        state = ServerState()
        first, second = (protocol(config=config, server_state=state, app_state={}) for _ in range(2))
        transports = [_Transport(), _Transport()]
        for connection, transport in zip((first, second), transports):
            connection.connection_made(transport)
        # every open connection of the server in one shared set, which the cap counts
        assert state.connections == {first, second} and first.connections is state.connections
        assert first.transport is transports[0] and first.loop is asyncio.get_running_loop()
        second.data_received(b"GET /infer HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(100):
            if transports[1].written:
                break
            await asyncio.sleep(0.01)
        assert scopes and scopes[0]["path"] == "/infer", scopes
        assert scopes[0].get(OVER_CAPACITY) is True  # the second of a cap of one: marked in its scope
        assert transports[1].written.startswith(b"HTTP/1.1 204"), bytes(transports[1].written)
        for connection in (first, second):
            connection.connection_lost(None)
        assert state.connections == set()

    asyncio.run(serve())


def test_triton_autotuner_is_what_the_kernels_drive(device):
    import torch
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    assert {"configs", "key", "prune_configs_by", "do_bench"} <= set(inspect.signature(triton.autotune).parameters)
    pruned, benched, runs = [], [], []

    def prune(configs, named_args, **kwargs):
        pruned.append((list(configs), dict(named_args)))
        return configs

    def bench(fn, quantiles=None):
        fn()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    def watched(fn, quantiles=None):
        benched.append(fn)
        return bench(fn, quantiles)

    configs = [triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)]

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)

    tuner = triton.autotune(configs=configs, key=["n"], prune_configs_by={"early_config_prune": prune},
                            do_bench=bench)(copy)
    assert isinstance(tuner, Autotuner) and tuner.configs == configs and tuner.cache == {}
    for config in configs:  # the fields the tuning tables write and read back (kernels/triton/_common.py)
        again = triton.Config(dict(config.kwargs), num_warps=config.num_warps, num_stages=config.num_stages,
                              num_ctas=config.num_ctas, maxnreg=config.maxnreg)
        assert again.all_kwargs() == config.all_kwargs(), (again.all_kwargs(), config.all_kwargs())
    # do_bench is read through the instance: an attribute shadows it, and taking it away shows the tuner's own again
    assert tuner.do_bench is bench
    tuner.__dict__["do_bench"] = watched
    assert tuner.do_bench is watched
    own_run = tuner.run
    tuner.run = lambda *args, **kwargs: runs.append(kwargs) or own_run(*args, **kwargs)

    n = 40
    src = torch.arange(n, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)
    tuner[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](src, dst, n)
    assert torch.equal(dst, src)
    assert runs, "a launch did not go through the instance's run"
    assert len(pruned) == 1 and pruned[0][0] == configs and list(pruned[0][1]) == ["src", "dst", "n"], pruned
    assert len(benched) == len(configs), "the autotuner timed its candidates without the instance's do_bench"
    del tuner.__dict__["do_bench"]
    assert tuner.do_bench is bench
    # the chosen config under a tuple key that a JSON table carries back (kernels/triton/_common.py seed_tuning)
    [(key, chosen)] = tuner.cache.items()
    assert isinstance(key, tuple) and tuple(json.loads(json.dumps(list(key)))) == key, key
    assert chosen in configs

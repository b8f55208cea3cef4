"""`fusedserve serve`: start the service with uvicorn."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import resource
import sys
import threading

import uvicorn

from fusedserve.server import devices, workers

log = logging.getLogger("fusedserve")


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: readiness and new requests answer 503 at once; after `drain_delay_s`
    uvicorn's graceful shutdown runs (stop accepting, finish in-flight requests, then the lifespan shutdown
    drains the batcher)."""

    def __init__(self, config: uvicorn.Config, service, drain_delay_s: float) -> None:
        super().__init__(config)
        self.service, self.drain_delay_s = service, drain_delay_s
        service.on_fatal = self.stop  # the model failed to load: nothing to drain, stop serving

    def stop(self) -> None:
        """Called from the loading thread; uvicorn's main loop checks the flag every tick."""
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if self.service.draining or self.drain_delay_s <= 0:
            self.service.start_draining()
            return super().handle_exit(sig, frame)
        self.service.start_draining()
        logging.getLogger("fusedserve").warning(
            "signal %s: reporting not-ready, closing the listener in %.1fs", sig, self.drain_delay_s)
        timer = threading.Timer(self.drain_delay_s, super().handle_exit, (sig, frame))
        timer.daemon = True
        timer.start()


def _open_files_to_the_hard_limit() -> None:
    """Each connection is a file descriptor, and the soft limit is often 1,024 (Docker's default too): raise it to the
    hard limit, as servers do, so connections run out long after the client's patience does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            log.warning("open files limit stays %d (could not raise it to %d)", soft, wanted)


# descriptors a server holds beside its connections: listeners, logs, pipes, the model's files, the metrics' files
FD_RESERVE = 256


def _connections_fit_open_files(settings) -> str | None:
    """Why the open-files limit cannot hold both ports' connection caps (None when it can). gRPC's core accepts its
    connections outside Python, where no handler can answer 503 once descriptors run short: a flood of gRPC
    connections would starve the HTTP port, probes included, unless both caps fit the limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    ports = {"HTTP": settings.max_connections, **({"gRPC": settings.max_connections} if settings.grpc_port else {})}
    need = sum(ports.values()) + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    caps = " + ".join(f"{n} {port}" for port, n in ports.items())
    return (f"the open files limit ({soft}) is below what max_connections needs: {caps} connections and {FD_RESERVE} "
            f"in reserve ({need}); lower FUSEDSERVE_MAX_CONNECTIONS or raise the limit (ulimit -n, the container's "
            "nofile)")


def main(argv: list[str] | None = None, app_factory=None, sockets: list | None = None) -> int:
    """app_factory: Settings -> app (default server.app.create_app; the tests mount their hooks through it).
    sockets: a worker of WORKERS > 1 (server.workers) serves on its parent's listening socket."""
    parser = argparse.ArgumentParser(prog="fusedserve serve", description="fusedserve embedding service. Settings "
                                     "come from FUSEDSERVE_* environment variables or a YAML/TOML file (--config); "
                                     "see docs/configuration.md for every setting.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", help="YAML or TOML settings file (the settings' names without the FUSEDSERVE_ prefix)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.config:
        os.environ["FUSEDSERVE_CONFIG"] = args.config
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from pydantic import ValidationError

    from fusedserve.server.config import Settings
    from fusedserve.server.observability import configure_logging
    from fusedserve.server.protocol import guarded

    try:
        settings = Settings()
    except (ValidationError, ValueError) as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, settings.log_format)
    if settings.grpc_port and settings.grpc_port == args.port:
        # both listen with SO_REUSEPORT, so the kernel would split the connections between HTTP and gRPC
        print(f"invalid configuration:\ngrpc_port {settings.grpc_port} is the HTTP port (--port): give gRPC a port "
              "of its own", file=sys.stderr)
        return 2
    _open_files_to_the_hard_limit()
    if (short := _connections_fit_open_files(settings)) is not None:
        print(f"invalid configuration:\n{short}", file=sys.stderr)
        return 2
    if sockets is None and settings.frontends:  # the parent of the engines and their front-ends
        if settings.workers != 1:
            print("invalid configuration:\nset FRONTENDS (front-ends before one engine per device) or WORKERS > 1 "
                  "(full server processes per device), not both", file=sys.stderr)
            return 2
        try:
            names = devices.devices(settings.device)
        except ValueError as exc:
            print(f"invalid configuration:\n{exc}", file=sys.stderr)
            return 2
        count = frontend_count(settings.frontends, names)
        os.environ["FUSEDSERVE_FRONTENDS"] = str(count)
        # the front-ends' settings name the engines' devices as they are (no `auto` to resolve, which would take
        # torch): the same batch limits follow from them as in the engines
        os.environ["FUSEDSERVE_DEVICE"] = ",".join(names)
        joined = ",".join(names)
        log.warning("%d front-ends in front of an engine on each of %s", count, joined)
        return workers.supervise([devices.Placement(joined, joined)] * count, list(sys.argv[1:] if argv is None
                                 else argv), args.host, args.port, functools.partial(workers.run_worker, main),
                                 engines=workers.EngineProcesses(names, args.log_level))
    if sockets is None:  # not a worker: one process, or a parent placing workers on the devices
        try:
            placements = devices.place(settings.device, settings.workers, _model_bytes(settings))
        except ValueError as exc:
            print(f"invalid configuration:\n{exc}", file=sys.stderr)
            return 2
        if len(placements) > 1:
            per_device = len(placements) // len({p.name for p in placements})
            log.warning("CUDA MPS: %s", devices.ensure_mps([p.name for p in placements], per_device))
            return workers.supervise(placements, list(sys.argv[1:] if argv is None else argv), args.host, args.port,
                                     functools.partial(workers.run_worker, main))
        if settings.workers == "auto":  # it came to one process
            settings = settings.model_copy(update={"workers": 1})
    # the app's imports (torch, the model package) only where it runs: a parent of workers starts them sooner
    from fusedserve.server.app import create_app

    app = (app_factory or create_app)(settings)
    app.state.host = args.host  # the gRPC service listens on the HTTP server's host
    # JSON logs: uvicorn's loggers propagate to the root's JSON handler instead of configuring their own format
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
                            timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
                            timeout_keep_alive=settings.idle_timeout_s,
                            http=guarded(settings.header_timeout_s, settings.max_connections))
    service = app.state.service
    DrainingServer(config, service, settings.drain_delay_s).run(sockets=sockets)
    if service.load_error is not None:
        print(f"start-up failed: {service.load_error}", file=sys.stderr)
        return 1
    return 0


def frontend_count(setting: int | str, names: list[str]) -> int:
    """FRONTENDS=auto: the CPUs left after the engines' own (two for each GPU's engine: its event loop and the
    thread that launches the forwards; on the CPU the engine's matmuls take every core, and one front-end goes
    beside it), at least one."""
    if setting != "auto":
        return int(setting)
    if names == ["cpu"]:
        return 1
    return max(1, devices.usable_cpus() - 2 * len(names))


def _model_bytes(settings) -> int | None:
    """The weights' bytes of the largest model served (WORKERS=auto fits the workers to the GPU memory)."""
    sizes = [devices.model_bytes(spec.path) for _, spec in settings.served_models()]
    return max((b for b in sizes if b), default=None)


if __name__ == "__main__":
    sys.exit(main())

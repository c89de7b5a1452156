"""`sanctum serve`: its flags (settings.py builds the settings from them), and the process
around the server (signals, a local Ray cluster on loopback, drain). grpc and Ray are imported
when the command runs."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("sanctum.api")


def register(sub) -> None:
    """`sanctum serve`."""
    from ..settings import add_model_flags

    s = sub.add_parser(
        "serve", help="serve gRPC (sanctum.v1.Inference) and HTTP (OpenAI's API) from the cluster"
    )
    add_model_flags(s)
    s.add_argument("--host", help="listen address (default SANCTUM_HOST or 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default SANCTUM_PORT or 1337)")
    s.add_argument(
        "--http-port",
        type=int,
        help="OpenAI-compatible HTTP API, /health and /metrics on the gRPC host (default "
        "SANCTUM_HTTP_PORT or 8080; 0: off)",
    )
    s.add_argument("--inline", action="store_true", help="run the roles in this process (no Ray)")
    s.add_argument(
        "--ladder", type=int, help="SSM ladder depth (default SANCTUM_MLX_SSM_LADDER or 4)"
    )
    s.add_argument(
        "--cache-dir", help="prompt-cache directory, or 'none' (default SANCTUM_HOME/prompt-cache)"
    )
    s.add_argument("--cache-bytes", type=int, help="prompt-cache size limit in bytes")
    s.add_argument(
        "--max-active", type=int, help="requests decoded concurrently, round by round (8)"
    )
    s.add_argument("--max-queue", type=int, help="requests allowed to wait beyond those (64)")
    s.add_argument(
        "--max-batch",
        type=int,
        help="decoding requests whose rounds share one drafter and one target forward "
        "(SANCTUM_MAX_BATCH, default: --max-active, all open requests; 1: one at a time)",
    )
    s.add_argument(
        "--transport",
        choices=("auto", "shm", "object_store"),
        help="per-round transport to the drafter and back to the front end (auto: shared "
        "memory and Unix sockets on one host, else the object store and Ray streams)",
    )
    for role in ("verifier", "drafter", "store"):
        s.add_argument(
            f"--{role}-resources",
            metavar="JSON",
            help=f"Ray custom resources for the {role} actor, e.g. '{{\"drafter_host\": 1}}'",
        )
    s.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to let streams finish on SIGTERM"
    )
    s.add_argument(
        "--auth-token-file",
        metavar="PATH",
        help="require 'authorization: Bearer <token in PATH>' on every RPC but health and "
        "reflection (default SANCTUM_AUTH_TOKEN_FILE; needed to listen beyond loopback)",
    )
    s.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    s.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    s.add_argument(
        "--tls-client-ca", metavar="PEM", help="mutual TLS: clients need a certificate it signed"
    )
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from ..settings import ROLES, model_flags, serve_settings, server_settings

    settings = serve_settings(
        **model_flags(args),
        ladder=args.ladder,
        cache_bytes=args.cache_bytes,
        cache_dir=args.cache_dir,
        max_active=args.max_active,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        transport=args.transport,
        resources={role: getattr(args, f"{role}_resources") for role in ROLES},
    )
    net = server_settings(
        args.host,
        args.port,
        args.auth_token_file,
        args.tls_cert,
        args.tls_key,
        args.tls_client_ca,
        http_port=args.http_port,
    )
    return serve(settings, net, args.inline, args.drain_timeout)


def serve(settings, net, inline: bool = False, drain_timeout: float = 30.0) -> int:
    """`sanctum serve`: gRPC on net.host:net.port, and HTTP on net.http_port (api/http.py, on
    the same loop and backend), over the actor cluster (a local Ray on loopback, or
    RAY_ADDRESS) or, with `inline`, over the roles in this process. Returns at the
    end of a drain. Access problems (a bad token file, no token beyond loopback) are refused
    before anything is loaded."""
    import signal

    from ..cluster.sockets import sweep_stale_socket_dirs
    from .guard import Access, check_exposure
    from .server import Server

    logging.basicConfig(
        level=settings.processes.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    access = Access.from_files(net.auth_token_file, net.tls_cert, net.tls_key, net.tls_client_ca)
    check_exposure(net.host, access)
    sweep_stale_socket_dirs()
    stop = threading.Event()

    def on_signals():  # again after ray.init, whose core worker installs its own SIGTERM handler
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())

    on_signals()
    ray_started = False
    if not inline:
        address = settings.processes.ray_address
        from ..cluster.localray import init_local_ray

        local = {}
        if not address and settings.processes.object_store_bytes:
            local["object_store_memory"] = settings.processes.object_store_bytes
        # before the gRPC server starts: Ray forks its processes, gRPC prefers no fork after start
        if address:
            import ray

            ray.init(address=address, namespace="sanctum", log_to_driver=True)
        else:
            init_local_ray(namespace="sanctum", log_to_driver=True, **local)
        ray_started = True
        on_signals()
    try:
        streams = settings.max_active + settings.max_queue + 8
        server = Server(
            None,
            net.host,
            net.port,
            net.max_message_bytes,
            max_streams=streams,
            access=access,
            limits=net.limits,
        )
        if net.http_port:
            try:
                server.start_http(net.http_port, http_tls(net))
            except BaseException:
                server.stop(0)
                raise
        log.info(
            "listening on %s%s (%s%s; NOT_SERVING until the models are loaded)",
            server.address,
            f", HTTP on port {server.http_port}" if server.http_port else "",
            "TLS" if access.tls_cert else "plaintext",
            ", bearer token" if access.token else "",
        )
        if inline:
            from ..serving.inline import InlineBackend

            backend = InlineBackend(settings)
        else:
            from ..cluster.backend import start_cluster

            backend = start_cluster(settings)
        server.attach(backend)
        server.ready()
        http = f", http://{net.host}:{server.http_port}" if server.http_port else ""
        print(
            f"sanctum: serving {settings.engine.model} on {server.address}{http} ({backend.mode})",
            flush=True,
        )
        while not stop.wait(0.25):  # a timeout: a signal landing on another thread still runs
            pass  # its Python handler only when the main thread wakes
        log.info("draining: health NOT_SERVING, new requests refused, in-flight ones finishing")
        server.drain(drain_timeout)
        server.stop(grace=1.0)
        backend.close()
        return 0
    finally:
        if ray_started:
            import ray

            ray.shutdown()


def http_tls(net) -> dict | None:
    """uvicorn's TLS options from the gRPC server's files (the same certificate, key and
    client CA serve both front ends)."""
    if not net.tls_cert:
        return None
    import ssl

    tls = {"ssl_certfile": net.tls_cert, "ssl_keyfile": net.tls_key}
    if net.tls_client_ca:
        tls.update(ssl_ca_certs=net.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return tls

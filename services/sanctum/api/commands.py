"""`sanctum serve`: argument parsing only (grpc and Ray are imported when the command runs)."""

from __future__ import annotations


def register(sub) -> None:
    """`sanctum serve`."""
    from ..cli import _add_model_flags

    s = sub.add_parser("serve", help="serve gRPC (sanctum.v1.Inference) from the actor cluster")
    _add_model_flags(s)
    s.add_argument("--host", help="listen address (default SANCTUM_HOST or 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default SANCTUM_PORT or 1337)")
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
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import json

    from ..cluster.backend import serve_settings
    from ..config import server_settings

    resources = {}
    for role in ("verifier", "drafter", "store"):
        raw = getattr(args, f"{role}_resources")
        if raw:
            try:
                resources[role] = json.loads(raw)
            except json.JSONDecodeError:
                raise ValueError(f"--{role}-resources is not JSON: {raw!r}") from None
    settings = serve_settings(
        args.model, args.drafter, args.block_size, args.bits, args.kv, args.ladder, args.cache_bytes,
        args.cache_dir, args.max_active, args.max_queue, args.transport, resources,
    )  # fmt: skip
    net = server_settings(args.host, args.port)
    from .server import serve

    return serve(
        settings, net.host, net.port, args.inline, args.drain_timeout, net.max_message_bytes
    )

"""Settings: one frozen dataclass per role, built in one place from defaults < environment < flags.

Environment keys keep the seed's names (SANCTUM_MLX_DFLASH2_DIR, SANCTUM_MLX_DFLASH2_BLOCK,
SANCTUM_MLX_DFLASH2_BITS, SANCTUM_MLX_SSM_LADDER) plus SANCTUM_MODEL, SANCTUM_KV, SANCTUM_HOST,
SANCTUM_PORT, SANCTUM_CACHE_BYTES, SANCTUM_CACHE_DIR and SANCTUM_HOME; the front end's access
(SANCTUM_AUTH_TOKEN_FILE, SANCTUM_TLS_CERT, SANCTUM_TLS_KEY, SANCTUM_TLS_CLIENT_CA) and connection
limits (SANCTUM_KEEPALIVE_S, SANCTUM_CONNECTION_IDLE_S, SANCTUM_CONNECTION_AGE_S,
SANCTUM_STREAM_IDLE_S, SANCTUM_SLOW_CLIENT_S, SANCTUM_STREAMS_PER_CONNECTION,
SANCTUM_MAX_CONNECTIONS).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_PAIR = ASSETS / "default"  # the trained pair shipped in the package, when present
# OpenBLAS idle workers spin 2^28 cycles (~0.1 s) after a call by default; 2^4: sleep at once,
# leaving the core to the other role process while this one waits (cli.py, cluster/actors.py)
OPENBLAS_IDLE_SPIN = "4"


def sanctum_home() -> Path:
    return Path(os.environ.get("SANCTUM_HOME", Path.home() / ".cache" / "sanctum"))


def default_pair() -> tuple[Path, Path]:
    """(target, drafter) used when no model is named: the shipped trained pair, or else a tiny
    random pair made on first use (what `make setup` also makes)."""
    if (DEFAULT_PAIR / "target" / "config.json").is_file():
        return DEFAULT_PAIR / "target", DEFAULT_PAIR / "drafter"
    tiny = sanctum_home() / "tiny"
    if not (tiny / "drafter" / "config.json").is_file():
        from .tiny import make_tiny

        make_tiny(tiny)
    return tiny / "target", tiny / "drafter"


def _env_int(env, key: str, default: int | None) -> int | None:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class EngineSettings:
    """What the verifier and drafter roles load."""

    model: str
    drafter: str | None  # None: plain decoding
    block_size: int | None  # None: the drafter config's
    drafter_bits: int  # 0: unquantized
    kv_mode: str  # "fp16" | "q8"


@dataclass(frozen=True)
class CacheSettings:
    """The prompt cache / ladder store."""

    ladder_depth: int
    max_bytes: int
    directory: str | None


def _env_float(env, key: str, default: float) -> float:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a number") from None


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may hold, as grpcio server options (plus the idle bound on
    request streams, enforced in api/guard.py). Long enough for any generation: a 4096-token
    stream takes minutes at worst; a Health.Watch is cut at the age limit and re-opened."""

    keepalive_s: float = 60.0  # ping a quiet connection this often ...
    keepalive_timeout_s: float = 20.0  # ... and drop it when the ping goes unanswered
    connection_idle_s: float = 300.0  # a connection without any RPC for this long is closed
    connection_age_s: float = 1800.0  # then asked to reconnect (GOAWAY) ...
    connection_age_grace_s: float = 600.0  # ... and closed this long after, RPCs or not
    stream_idle_s: float = 30.0  # a request stream (reflection) without a message: closed
    slow_client_s: float = 30.0  # a response stream whose client takes nothing: closed
    streams_per_connection: int = 100  # HTTP/2 MAX_CONCURRENT_STREAMS: the bound per client
    max_connections: int = 1000

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = lambda s: int(s * 1000)
        return [
            ("grpc.keepalive_time_ms", ms(self.keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.max_connection_idle_ms", ms(self.connection_idle_s)),
            ("grpc.max_connection_age_ms", ms(self.connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.connection_age_grace_s)),
            ("grpc.max_concurrent_streams", self.streams_per_connection),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
        ]


def connection_limits(env=os.environ) -> ConnectionLimits:
    d = ConnectionLimits()
    return ConnectionLimits(
        keepalive_s=_env_float(env, "SANCTUM_KEEPALIVE_S", d.keepalive_s),
        keepalive_timeout_s=d.keepalive_timeout_s,
        connection_idle_s=_env_float(env, "SANCTUM_CONNECTION_IDLE_S", d.connection_idle_s),
        connection_age_s=_env_float(env, "SANCTUM_CONNECTION_AGE_S", d.connection_age_s),
        connection_age_grace_s=d.connection_age_grace_s,
        stream_idle_s=_env_float(env, "SANCTUM_STREAM_IDLE_S", d.stream_idle_s),
        slow_client_s=_env_float(env, "SANCTUM_SLOW_CLIENT_S", d.slow_client_s),
        streams_per_connection=_env_int(env, "SANCTUM_STREAMS_PER_CONNECTION",
                                        d.streams_per_connection),
        max_connections=_env_int(env, "SANCTUM_MAX_CONNECTIONS", d.max_connections),
    )  # fmt: skip


@dataclass(frozen=True)
class ServerSettings:
    host: str
    port: int
    max_queue: int
    max_message_bytes: int
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    limits: ConnectionLimits = ConnectionLimits()


def engine_settings(
    model: str | None = None,
    drafter: str | None = None,
    block_size: int | None = None,
    bits: int | None = None,
    kv_mode: str | None = None,
    env=os.environ,
) -> EngineSettings:
    """Flags (non-None arguments) override the environment, which overrides defaults.
    `drafter="none"` turns speculation off."""
    model = model or env.get("SANCTUM_MODEL")
    drafter = drafter or env.get("SANCTUM_MLX_DFLASH2_DIR")
    if model is None:
        default_target, default_drafter = default_pair()
        model = str(default_target)
        drafter = drafter or str(default_drafter)
    if drafter in ("none", ""):
        drafter = None
    block = (
        block_size if block_size is not None else _env_int(env, "SANCTUM_MLX_DFLASH2_BLOCK", None)
    )
    bits = bits if bits is not None else _env_int(env, "SANCTUM_MLX_DFLASH2_BITS", 0)
    kv = kv_mode or env.get("SANCTUM_KV", "fp16")
    if kv not in ("fp16", "q8"):
        raise ValueError(f"kv mode must be fp16 or q8, got {kv!r}")
    if block is not None and block < 2:
        raise ValueError(f"block size must be >= 2, got {block}")
    return EngineSettings(model, drafter, block, 0 if bits in (0, 16) else bits, kv)


def cache_settings(
    ladder: int | None = None,
    max_bytes: int | None = None,
    directory: str | None = None,
    env=os.environ,
) -> CacheSettings:
    depth = ladder if ladder is not None else _env_int(env, "SANCTUM_MLX_SSM_LADDER", 4)
    size = max_bytes if max_bytes is not None else _env_int(env, "SANCTUM_CACHE_BYTES", 2 << 30)
    return CacheSettings(depth, size, directory or env.get("SANCTUM_CACHE_DIR") or None)


def server_settings(
    host: str | None = None,
    port: int | None = None,
    auth_token_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    env=os.environ,
) -> ServerSettings:
    return ServerSettings(
        host=host or env.get("SANCTUM_HOST", "127.0.0.1"),
        port=port if port is not None else _env_int(env, "SANCTUM_PORT", 1337),
        max_queue=_env_int(env, "SANCTUM_MAX_QUEUE", 64),
        max_message_bytes=_env_int(env, "SANCTUM_MAX_MESSAGE_BYTES", 16 << 20),
        auth_token_file=auth_token_file or env.get("SANCTUM_AUTH_TOKEN_FILE") or None,
        tls_cert=tls_cert or env.get("SANCTUM_TLS_CERT") or None,
        tls_key=tls_key or env.get("SANCTUM_TLS_KEY") or None,
        tls_client_ca=tls_client_ca or env.get("SANCTUM_TLS_CLIENT_CA") or None,
        limits=connection_limits(env),
    )


ROLES = ("verifier", "drafter", "store")


@dataclass(frozen=True)
class ServeSettings:
    """Everything `sanctum serve` (or a test, or a benchmark) decides about the roles."""

    engine: EngineSettings
    cache: CacheSettings
    max_active: int = 8  # requests interleaved round by round
    max_queue: int = 64  # more requests may wait; beyond that RESOURCE_EXHAUSTED
    max_tokens_limit: int = 4096
    transport: str = "auto"  # drafter + events paths: auto (by Ray node) | shm | object_store
    round_delay_s: float = 0.0  # benchmark/test knob: a slower target (a wait in every forward)
    round_delay_busy: bool = False  # the wait keeps the core busy (benchmarks) or sleeps (tests)
    resources: dict = field(default_factory=dict)  # role -> Ray custom resources (placement)


def serve_settings(
    model=None, drafter=None, block_size=None, bits=None, kv_mode=None, ladder=None,
    cache_bytes=None, cache_dir=None, max_active=None, max_queue=None, transport=None,
    resources=None, round_delay_ms=0.0, round_delay_busy=False, env=os.environ,
) -> ServeSettings:  # fmt: skip
    """Flags (non-None) over environment over defaults. The prompt cache persists in
    SANCTUM_HOME/prompt-cache unless a directory (or "none") is given."""
    engine = engine_settings(model, drafter, block_size, bits, kv_mode, env=env)
    cache = cache_settings(ladder, cache_bytes, cache_dir, env=env)
    if cache.directory is None:
        cache = CacheSettings(
            cache.ladder_depth, cache.max_bytes, str(sanctum_home() / "prompt-cache")
        )
    elif cache.directory == "none":
        cache = CacheSettings(cache.ladder_depth, cache.max_bytes, None)
    res = dict(resources or {})
    for role in ROLES:
        raw = env.get(f"SANCTUM_{role.upper()}_RESOURCES")
        if raw and role not in res:
            try:
                res[role] = json.loads(raw)
            except json.JSONDecodeError:
                raise ValueError(f"SANCTUM_{role.upper()}_RESOURCES is not JSON: {raw!r}") from None
    transport = transport or env.get("SANCTUM_TRANSPORT", "auto")
    if transport not in ("auto", "shm", "object_store"):
        raise ValueError(f"transport must be auto, shm or object_store, got {transport!r}")
    return ServeSettings(
        engine, cache,
        max_active=max_active or int(env.get("SANCTUM_MAX_ACTIVE", 8)),
        max_queue=max_queue if max_queue is not None else int(env.get("SANCTUM_MAX_QUEUE", 64)),
        transport=transport, round_delay_s=(round_delay_ms or 0.0) / 1000.0,
        round_delay_busy=round_delay_busy, resources=res,
    )  # fmt: skip

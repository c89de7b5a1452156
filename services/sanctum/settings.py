"""Settings: one frozen dataclass per role, built in one place: defaults < environment < flags.

Every environment variable that sanctum's serving side reads is read here, once, by the builder
of the settings it belongs to (`engine_settings`, `cache_settings`, `server_settings`,
`serve_settings`, `client_token`); everything else takes what these built, and a role process
gets its settings from the front end, not from its own environment. A field names its variable
(`var("SANCTUM_KV", ...)`) and `read` fills a dataclass: a flag that is not None, else the
variable when set and not empty, else the field's default. Names keep the seed's
(SANCTUM_MLX_DFLASH2_DIR, SANCTUM_MLX_DFLASH2_BLOCK, SANCTUM_MLX_DFLASH2_BITS,
SANCTUM_MLX_SSM_LADDER); README's configuration table lists them all.

The engine's device switches (`DeviceSettings`: which device path, which kernels, the CPU
JIT) are read here too, by `device_settings`; the engine takes them from `device()`, which a
test can replace (`use_device`). Read elsewhere, on purpose: cli.py's OpenBLAS re-exec
(SANCTUM_NO_OPENBLAS, LD_PRELOAD), before anything else is imported.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_PAIR = ASSETS / "default"  # the trained pair shipped in the package, when present
# OpenBLAS idle workers spin 2^28 cycles after a call by default; 2^4: sleep at once,
# leaving the core to the other role process while this one waits (cli.py, cluster/backend.py)
OPENBLAS_IDLE_SPIN = "4"
ROLES = ("verifier", "drafter", "store")
KV_MODES = ("fp16", "q8")  # the attention KV formats the engine keeps (engine/model/target.py)
ACCEPT_RULES = ("block", "token")  # how sampled drafts are accepted (engine/decode/sampling.py)
TRANSPORTS = ("auto", "shm", "object_store")
Env = Mapping[str, str]


# ---- reading ---------------------------------------------------------------------------------


def var(name: str, default=None, parse: Callable[[str], object] = str):
    """A settings field that environment variable `name` sets (parsed by `parse`)."""
    return field(default=default, metadata={"env": name, "parse": parse})


def _parse(name: str, raw: str, parse: Callable[[str], object]):
    try:
        return parse(raw)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(parse, "valid")
        raise ValueError(f"{name}={raw!r} is not {what}") from None


def read(cls, env: Env, **flags):
    """`cls` from `flags` (None: not given), else its fields' environment variables, else the
    fields' defaults."""
    values = {}
    for f in fields(cls):
        name = f.metadata.get("env")
        if flags.get(f.name) is not None:
            values[f.name] = flags[f.name]
        elif name is not None and env.get(name) not in (None, ""):
            values[f.name] = _parse(name, env[name], f.metadata["parse"])
    return cls(**values)


def sanctum_home(env: Env = os.environ) -> Path:
    """Where sanctum keeps what it makes (tiny pairs, seed checkpoints, the prompt cache)."""
    return Path(env.get("SANCTUM_HOME") or Path.home() / ".cache" / "sanctum")


def default_pair(env: Env = os.environ) -> tuple[Path, Path]:
    """(target, drafter) used when no model is named: the shipped trained pair, or else a tiny
    random pair under SANCTUM_HOME, which `tiny.ensure_pair` makes on first use (loading the
    models does)."""
    if (DEFAULT_PAIR / "target" / "config.json").is_file():
        return DEFAULT_PAIR / "target", DEFAULT_PAIR / "drafter"
    tiny = sanctum_home(env) / "tiny"
    return tiny / "target", tiny / "drafter"


# ---- the engine and the prompt cache ---------------------------------------------------------


@dataclass(frozen=True)
class EngineSettings:
    """What the verifier and drafter roles load."""

    model: str = var("SANCTUM_MODEL")  # target checkpoint dir or cached hub id
    drafter: str | None = var("SANCTUM_MLX_DFLASH2_DIR")  # None: plain decoding
    block_size: int | None = var("SANCTUM_MLX_DFLASH2_BLOCK", None, int)  # None: drafter config's
    drafter_bits: int = var("SANCTUM_MLX_DFLASH2_BITS", 0, int)  # 0: unquantized
    kv_mode: str = var("SANCTUM_KV", "fp16")  # one of KV_MODES


@dataclass(frozen=True)
class CacheSettings:
    """The prompt cache / ladder store."""

    ladder_depth: int = var("SANCTUM_MLX_SSM_LADDER", 4, int)
    # rung bytes per conversation (the latest entry's own rungs and those it adopts from the
    # turns before it); 0: the entry's own rungs and two more
    ladder_bytes: int = var("SANCTUM_MLX_SSM_LADDER_BYTES", 0, int)
    max_bytes: int = var("SANCTUM_CACHE_BYTES", 2 << 30, int)
    directory: str | None = var("SANCTUM_CACHE_DIR")  # None: in memory only


def engine_settings(
    model: str | None = None,
    drafter: str | None = None,
    block_size: int | None = None,
    bits: int | None = None,
    kv_mode: str | None = None,
    env: Env = os.environ,
) -> EngineSettings:
    """Flags (non-None arguments) override the environment, which overrides defaults.
    `drafter="none"` turns speculation off; no model: the default pair (its drafter too)."""
    s = read(
        EngineSettings,
        env,
        model=model,
        drafter=drafter,
        block_size=block_size,
        drafter_bits=bits,
        kv_mode=kv_mode,
    )
    if s.model is None:
        default_target, default_drafter = default_pair(env)
        s = replace(s, model=str(default_target), drafter=s.drafter or str(default_drafter))
    if s.drafter in ("none", ""):
        s = replace(s, drafter=None)
    if s.drafter_bits == 16:
        s = replace(s, drafter_bits=0)
    if s.kv_mode not in KV_MODES:
        raise ValueError(f"kv mode must be fp16 or q8, got {s.kv_mode!r}")
    if s.block_size is not None and s.block_size < 2:
        raise ValueError(f"block size must be >= 2, got {s.block_size}")
    return s


def cache_settings(
    ladder: int | None = None,
    max_bytes: int | None = None,
    directory: str | None = None,
    env: Env = os.environ,
) -> CacheSettings:
    return read(CacheSettings, env, ladder_depth=ladder, max_bytes=max_bytes, directory=directory)


# ---- the engine's device ----------------------------------------------------------------------

DEVICE_PATHS = ("auto", "cpu", "cuda", "metal")
QMM_WIDE_MODES = ("auto", "wide", "off")  # 17..64 rows: tiled or wide kernel | wide | 16 a call
QMM_TILED_AHEAD = (1, 2, 3)  # tiles of weights a tiled 4-bit kernel's warp has in flight
QMM_TILED_RESIDENT = (1, 2)  # thread blocks of the tiled 4-bit kernel an SM holds at once
SHARED_ROLLBACKS = ("gather", "views", "rerun")
CUDA_BUILDS = ("cache", "mlx")  # sanctum's CUDA kernels: built once and kept | built by MLX
CUDNN_FLAGS = ("MLX_CUDA_USE_CUDNN_SDPA", "MLX_CUDA_USE_CUDNN_SPDA")  # MLX's, older spelling too


@dataclass(frozen=True)
class DeviceSettings:
    """How the engine runs on this process's device: each process reads its own (the device,
    its kernels and its compiler are the process's)."""

    # which device path the engine takes (engine/kernels/platform.py); auto: the MLX device's
    path: str = var("SANCTUM_DEVICE_PATH", "auto")
    # attention over 8-bit KV: auto | quantized | dequantized (auto: dequantized on CUDA)
    q8_attention: str = var("SANCTUM_Q8_ATTENTION", "auto")
    gdn_kernel: str = var("SANCTUM_GDN_KERNEL", "auto")  # off: the MLX path on CUDA
    qmm_kernel: str = var("SANCTUM_QMM_KERNEL", "auto")  # off: MLX's 4-bit matmul on CUDA
    qmm_split_rows: int = var("SANCTUM_QMM_SPLIT_ROWS", 64, int)  # most rows through it
    qmm_wide: str = var("SANCTUM_QMM_WIDE", "auto")  # QMM_WIDE_MODES (cuda._prepare_wide)
    qmm_tiled_ahead: int = var("SANCTUM_QMM_TILED_AHEAD", 1, int)  # weight tiles in flight
    qmm_tiled_resident: int = var("SANCTUM_QMM_TILED_RESIDENT", 1, int)  # its blocks an SM
    draft_kernels: str = var("SANCTUM_DRAFT_KERNELS", "auto")  # off: MLX's ops on CUDA
    # cache: sanctum's CUDA kernels built with NVRTC once and kept (engine/kernels/build.py);
    # mlx: built by mx.fast.cuda_kernel in every process
    cuda_builds: str = var("SANCTUM_CUDA_BUILDS", "cache")
    # how a shared verify through the GDN kernel is rolled back: gather | views | rerun (gdn.py)
    shared_rollback: str = var("SANCTUM_SHARED_ROLLBACK", "views")
    fused_projections: str = var("SANCTUM_FUSED_PROJECTIONS", "on")  # off: each on its own
    cpu_jit: str = var("SANCTUM_CPU_JIT", "native")  # off: MLX's own compiler command
    draft_ahead: str = var("SANCTUM_DRAFT_AHEAD", "auto")  # auto (on a GPU) | on | off
    lookup_min: str | None = var("SANCTUM_LOOKUP_MIN")  # None: engine/decode/lookup.py's
    home: str = ""  # SANCTUM_HOME (`sanctum_home`): where kernel checks are remembered
    search_path: str = var("PATH", "")  # where the CPU JIT finds g++
    cudnn_sdpa: tuple[tuple[str, str | None], ...] = ()  # CUDNN_FLAGS as the environment sets them


def device_settings(env: Env = os.environ) -> DeviceSettings:
    """The engine's device settings from `env`."""
    s = read(
        DeviceSettings,
        env,
        home=str(sanctum_home(env)),
        cudnn_sdpa=tuple((f, env.get(f)) for f in CUDNN_FLAGS),
    )
    if s.path not in DEVICE_PATHS:
        raise ValueError(f"SANCTUM_DEVICE_PATH must be one of {DEVICE_PATHS}, got {s.path!r}")
    if s.qmm_wide not in QMM_WIDE_MODES:
        raise ValueError(f"SANCTUM_QMM_WIDE must be one of {QMM_WIDE_MODES}, got {s.qmm_wide!r}")
    if s.qmm_tiled_ahead not in QMM_TILED_AHEAD:
        raise ValueError(
            f"SANCTUM_QMM_TILED_AHEAD must be one of {QMM_TILED_AHEAD}, got {s.qmm_tiled_ahead}"
        )
    if s.qmm_tiled_resident not in QMM_TILED_RESIDENT:
        raise ValueError(
            f"SANCTUM_QMM_TILED_RESIDENT must be one of {QMM_TILED_RESIDENT},"
            f" got {s.qmm_tiled_resident}"
        )
    if s.cuda_builds not in CUDA_BUILDS:
        raise ValueError(f"SANCTUM_CUDA_BUILDS must be one of {CUDA_BUILDS}, got {s.cuda_builds!r}")
    if s.shared_rollback not in SHARED_ROLLBACKS:
        raise ValueError(
            f"SANCTUM_SHARED_ROLLBACK must be one of {SHARED_ROLLBACKS}, got {s.shared_rollback!r}"
        )
    return s


_DEVICE_VARS = tuple(f.metadata["env"] for f in fields(DeviceSettings) if "env" in f.metadata)
_device: tuple[tuple, DeviceSettings] | None = None  # (the variables it was read from, it)
_device_override: DeviceSettings | None = None


def device() -> DeviceSettings:
    """The device settings in force: a test's (`use_device`), else this process's environment's
    (built again only when one of its variables changed)."""
    global _device
    if _device_override is not None:
        return _device_override
    seen = tuple(os.environ.get(name) for name in (*_DEVICE_VARS, "SANCTUM_HOME", *CUDNN_FLAGS))
    if _device is None or _device[0] != seen:
        _device = (seen, device_settings())
    return _device[1]


@contextmanager
def use_device(settings: DeviceSettings | None = None, **changes) -> Iterator[DeviceSettings]:
    """Inside the block the engine takes `settings` (default: the current ones) with `changes`."""
    global _device_override
    before = _device_override
    _device_override = replace(settings or device(), **changes)
    try:
        yield _device_override
    finally:
        _device_override = before


# ---- the front end ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may hold, as grpcio server options (plus the idle bound on
    request streams, enforced in api/guard.py). Long enough for any generation: a 4096-token
    stream takes minutes at worst; a Health.Watch is cut at the age limit and re-opened."""

    keepalive_s: float = var("SANCTUM_KEEPALIVE_S", 60.0, float)  # ping a quiet connection ...
    keepalive_timeout_s: float = 20.0  # ... and drop it when the ping goes unanswered
    # a connection without any RPC for this long is closed
    connection_idle_s: float = var("SANCTUM_CONNECTION_IDLE_S", 300.0, float)
    # then asked to reconnect (GOAWAY) ...
    connection_age_s: float = var("SANCTUM_CONNECTION_AGE_S", 1800.0, float)
    connection_age_grace_s: float = 600.0  # ... and closed this long after, RPCs or not
    # a request stream (reflection) without a message: closed
    stream_idle_s: float = var("SANCTUM_STREAM_IDLE_S", 30.0, float)
    # a response stream whose client takes nothing: closed
    slow_client_s: float = var("SANCTUM_SLOW_CLIENT_S", 30.0, float)
    # HTTP/2 MAX_CONCURRENT_STREAMS: the bound per client
    streams_per_connection: int = var("SANCTUM_STREAMS_PER_CONNECTION", 100, int)
    max_connections: int = var("SANCTUM_MAX_CONNECTIONS", 1000, int)

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


@dataclass(frozen=True)
class ServerSettings:
    """The front ends (gRPC, and HTTP on the same host): where they listen, who may call, how
    large a message may be."""

    host: str = var("SANCTUM_HOST", "127.0.0.1")
    port: int = var("SANCTUM_PORT", 1337, int)
    http_port: int = var("SANCTUM_HTTP_PORT", 8080, int)  # on `host`; 0: no HTTP front end
    max_message_bytes: int = var("SANCTUM_MAX_MESSAGE_BYTES", 16 << 20, int)
    auth_token_file: str | None = var("SANCTUM_AUTH_TOKEN_FILE")
    tls_cert: str | None = var("SANCTUM_TLS_CERT")
    tls_key: str | None = var("SANCTUM_TLS_KEY")
    tls_client_ca: str | None = var("SANCTUM_TLS_CLIENT_CA")
    limits: ConnectionLimits = ConnectionLimits()


def server_settings(
    host: str | None = None,
    port: int | None = None,
    auth_token_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_client_ca: str | None = None,
    env: Env = os.environ,
    http_port: int | None = None,
) -> ServerSettings:
    return read(
        ServerSettings,
        env,
        host=host or None,
        port=port,
        http_port=http_port,
        auth_token_file=auth_token_file or None,
        tls_cert=tls_cert or None,
        tls_key=tls_key or None,
        tls_client_ca=tls_client_ca or None,
        limits=read(ConnectionLimits, env),
    )


def client_token(token: str | None = None, env: Env = os.environ) -> str | None:
    """The bearer token a client sends: `token`, else SANCTUM_AUTH_TOKEN, else the contents of
    SANCTUM_AUTH_TOKEN_FILE (the file the server reads its token from), else none."""
    if token:
        return token.strip()
    if env.get("SANCTUM_AUTH_TOKEN"):
        return env["SANCTUM_AUTH_TOKEN"].strip()
    if env.get("SANCTUM_AUTH_TOKEN_FILE"):
        return Path(env["SANCTUM_AUTH_TOKEN_FILE"]).read_text().strip() or None
    return None


# ---- the roles -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleProcesses:
    """How the role processes run: read where `sanctum serve` starts, applied in each actor."""

    log_level: str = var("SANCTUM_LOG", "INFO")
    # Python's GIL switch interval in the actors (None: Python's 5 ms)
    switch_interval_s: float | None = var("SANCTUM_SWITCH_INTERVAL_S", None, float)
    # BLAS threads of the verifier and the drafter (None: the CPUs this process may use)
    verifier_threads: str | None = var("OMP_NUM_THREADS")
    drafter_threads: str | None = var("SANCTUM_DRAFTER_THREADS")
    blas_thread_timeout: str = var("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_IDLE_SPIN)
    ray_address: str | None = var("RAY_ADDRESS")  # None: a local cluster on loopback
    object_store_bytes: int | None = var("SANCTUM_OBJECT_STORE_BYTES", None, int)  # local one


@dataclass(frozen=True)
class ServeSettings:
    """Everything `sanctum serve` (or a test, or a benchmark) decides about the roles."""

    engine: EngineSettings
    cache: CacheSettings
    max_active: int = var("SANCTUM_MAX_ACTIVE", 8, int)  # requests interleaved round by round
    max_queue: int = var("SANCTUM_MAX_QUEUE", 64, int)  # may wait more; then RESOURCE_EXHAUSTED
    # open requests whose rounds share one drafter and one target forward (1: one at a time;
    # None: max_active, every open request in one shared round)
    max_batch: int | None = var("SANCTUM_MAX_BATCH", None, int)
    # 1: run shared rounds at every batch size up to max_batch once at load, so a stream
    # joining later does not stall the running ones while that size's graphs are built
    warm_shared: int = var("SANCTUM_WARM_SHARED", 1, int)
    # 1: a sequence whose drafts keep failing drafts smaller blocks (DecodePolicy.adaptive)
    adaptive_width: int = var("SANCTUM_ADAPTIVE_WIDTH", 0, int)
    # how sampled drafts are accepted: block verification or the token rule (engine/decode/sampling.py)
    accept_rule: str = var("SANCTUM_ACCEPT_RULE", "block")
    # the speculation gate (DecodePolicy.min_tau): a sequence whose rounds commit fewer tokens
    # than this on average takes plain steps for a while; "auto": what a round costs in plain
    # steps, measured at load (rounded down to a quarter); 0: off
    min_tau: str = var("SANCTUM_MIN_TAU", "auto")
    # greedy rounds whose last tokens repeat an earlier stretch this long propose what followed
    # it (DecodePolicy.lookup_min, engine/decode/lookup.py); 0: off; None: the engine's default
    lookup_min: int | None = var("SANCTUM_LOOKUP_MIN", None, int)
    max_tokens_limit: int = 4096
    # prompt tokens prefilled before the other requests get their next round, fewer if they
    # would take longer than prefill_slice_ms (serving/scheduler.py)
    prefill_slice: int = var("SANCTUM_PREFILL_SLICE", 512, int)
    prefill_slice_ms: float = var("SANCTUM_PREFILL_SLICE_MS", 250.0, float)
    # drafter + events paths: auto (by Ray node) | shm | object_store
    transport: str = var("SANCTUM_TRANSPORT", "auto")
    resources: dict = field(default_factory=dict)  # role -> Ray custom resources (placement)
    processes: RoleProcesses = RoleProcesses()


def _json(what: str, raw: str | dict) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"{what} is not JSON: {raw!r}") from None


def serve_settings(
    model: str | None = None,
    drafter: str | None = None,
    *,
    block_size: int | None = None,
    bits: int | None = None,
    kv_mode: str | None = None,
    ladder: int | None = None,
    cache_bytes: int | None = None,
    cache_dir: str | None = None,
    max_active: int | None = None,
    max_queue: int | None = None,
    max_batch: int | None = None,
    transport: str | None = None,
    resources: Mapping[str, str | dict | None] | None = None,
    env: Env = os.environ,
) -> ServeSettings:
    """The `sanctum serve` flags (None: not given) over the environment over defaults. The
    prompt cache persists in SANCTUM_HOME/prompt-cache unless a directory (or "none") is given;
    `resources` maps a role to its Ray resources (JSON, as `--drafter-resources` takes them)."""
    engine = engine_settings(model, drafter, block_size, bits, kv_mode, env=env)
    cache = cache_settings(ladder, cache_bytes, cache_dir, env=env)
    if cache.directory is None:
        cache = replace(cache, directory=str(sanctum_home(env) / "prompt-cache"))
    elif cache.directory == "none":
        cache = replace(cache, directory=None)
    placed = {}
    for role in ROLES:
        flag, name = (resources or {}).get(role), f"SANCTUM_{role.upper()}_RESOURCES"
        if flag:
            placed[role] = _json(f"--{role}-resources", flag)
        elif env.get(name):
            placed[role] = _json(name, env[name])
    s = read(
        ServeSettings,
        env,
        engine=engine,
        cache=cache,
        max_active=max_active or None,
        max_queue=max_queue,
        max_batch=max_batch,
        transport=transport,
        resources=placed,
        processes=read(RoleProcesses, env),
    )
    if s.transport not in TRANSPORTS:
        raise ValueError(f"transport must be auto, shm or object_store, got {s.transport!r}")
    if s.max_batch is None:  # shared rounds by default: never slower than one at a time
        s = replace(s, max_batch=s.max_active)
    elif s.max_batch < 1:
        raise ValueError(
            f"SANCTUM_MAX_BATCH must be >= 1 (1: one request at a time), got {s.max_batch}"
        )
    if s.min_tau != "auto":
        try:
            ok = float(s.min_tau) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"SANCTUM_MIN_TAU must be auto or a number >= 0, got {s.min_tau!r}")
    if s.lookup_min is not None and s.lookup_min < 0:
        raise ValueError(f"SANCTUM_LOOKUP_MIN must be >= 0 (0: off), got {s.lookup_min}")
    if s.accept_rule not in ACCEPT_RULES:
        raise ValueError(
            f"SANCTUM_ACCEPT_RULE must be one of {', '.join(ACCEPT_RULES)}, got {s.accept_rule!r}"
        )
    return s


# ---- flags -----------------------------------------------------------------------------------


# the engine settings' flags: `engine_settings` argument -> command-line option
MODEL_FLAGS = {
    "model": "--model",
    "drafter": "--drafter",
    "block_size": "--block-size",
    "bits": "--bits",
    "kv_mode": "--kv",
}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --drafter, --block-size, --bits, --kv: the engine settings' flags."""
    p.add_argument("--model", help="target checkpoint dir or hub id (default: the embedded pair)")
    p.add_argument(
        "--drafter", help="drafter checkpoint dir or hub id, or 'none' for plain decoding"
    )
    p.add_argument("--block-size", type=int, help="draft block size (default: drafter config)")
    p.add_argument("--bits", type=int, help="quantize the drafter at load (4, 8; 0 = none)")
    p.add_argument("--kv", dest="kv_mode", choices=KV_MODES, help="attention KV cache format")


def model_flags(args: argparse.Namespace) -> dict:
    """The engine flags of parsed arguments, as `engine_settings` and `serve_settings` take them."""
    return {name: getattr(args, name, None) for name in MODEL_FLAGS}

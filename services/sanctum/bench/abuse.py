"""`sanctum bench abuse`: one normal stream against abusive clients (the hardening limits).

While a normal greedy stream runs, it sends a 15 MB text prompt, an 800-message chat (30 KB),
100 stop strings of 10 KB, 100 idle server-reflection streams (each on its own connection,
opened and never half-closed), a malformed protobuf message, and garbage on the wire (bytes that
are not HTTP/2, and HTTP/2 frames with a corrupt header block), and polls health every 100 ms.
It prints the normal stream's worst gap between chunks (the goal: under a second on a 2-core
machine) and what each abuser got back.

By default it starts its own `sanctum serve` (the actor cluster, or `--inline`) on a free
loopback port, with the request-stream idle limit at `--stream-idle-s` so that the idle streams'
fate shows within the run; `--server HOST:PORT` aims at a running one instead (the token from
SANCTUM_AUTH_TOKEN).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

from ..settings import MODEL_FLAGS, add_model_flags, model_flags

NORMAL_PROMPT = "def fibonacci(n):"


def add_parser(bsub) -> None:
    p = bsub.add_parser("abuse", help="a normal stream's worst gap while abusive clients hammer")
    add_model_flags(p)
    p.add_argument("--server", help="HOST:PORT of a running server (default: start one)")
    p.add_argument("--inline", action="store_true", help="the started server: roles inline")
    p.add_argument("--prompt-mb", type=float, default=15.0)
    p.add_argument("--chat-messages", type=int, default=800)
    p.add_argument("--idle-streams", type=int, default=100)
    p.add_argument("--stream-idle-s", type=float, default=5.0, help="the started server's limit")
    p.add_argument("--json", action="store_true")


def run(args) -> dict:
    """Start (or reach) the server, run the abuse, return the figures."""
    if args.server:
        return abuse(args.server, args)
    with _started_server(args) as address:
        return abuse(address, args)


class _started_server:
    """`sanctum serve` in a subprocess on a free loopback port; SIGTERM (drain) at the end."""

    def __init__(self, args):
        self.args = args

    def __enter__(self) -> str:
        from ..api.client import Client

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.home = tempfile.TemporaryDirectory(prefix="sanctum-abuse-")
        env = dict(
            os.environ,
            SANCTUM_HOME=self.home.name,
            SANCTUM_STREAM_IDLE_S=str(self.args.stream_idle_s),
        )
        cmd = [
            sys.executable,
            "-m",
            "sanctum.cli",
            "serve",
            "--port",
            str(port),
            "--cache-dir",
            "none",
            "--http-port",
            "0",  # gRPC only: what the bench measures
            *(["--inline"] if self.args.inline else []),
        ]
        for name, value in model_flags(self.args).items():
            if value is not None:
                cmd += [MODEL_FLAGS[name], str(value)]
        self.log = open(os.path.join(self.home.name, "serve.log"), "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        address = f"127.0.0.1:{port}"
        with Client(address) as c:
            try:
                c.wait_serving(600)
            except TimeoutError:
                self.__exit__()
                raise
        return address

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        self.home.cleanup()


def abuse(address: str, args) -> dict:
    """The normal stream and the abusers at once; the figures."""
    import grpc

    from ..api.client import Client

    own = [("grpc.use_local_subchannel_pool", 1)]  # grpcio would share one connection
    normal = Client(address, options=own)
    gaps, gap_ends, first_chunk, normal_error = [], [], [], []
    started, stop = threading.Event(), threading.Event()

    def normal_stream():
        while not stop.is_set():  # another stream if one ends (EOS) before the abuse does
            call = normal.stream(_request(NORMAL_PROMPT, 4000))
            t0 = last = time.perf_counter()
            try:
                for i, _ in enumerate(call):
                    now = time.perf_counter()
                    if i == 0:
                        first_chunk.append(now - t0)
                    else:
                        gaps.append(now - last)
                        gap_ends.append(now)
                    last = now
                    if i == 3:
                        started.set()
                    if stop.is_set():
                        call.cancel()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    normal_error.append(f"{exc.code().name}: {exc.details()}")
                    return

    health = {"checks": 0, "not_serving": 0, "worst_ms": 0.0}

    def poll_health():
        with Client(address, options=own) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = c.health(timeout=5) == "SERVING"
                except grpc.RpcError:
                    ok = False
                health["checks"] += 1
                health["not_serving"] += not ok
                health["worst_ms"] = max(health["worst_ms"], 1000 * (time.perf_counter() - t0))
                time.sleep(0.1)

    threads = [threading.Thread(target=normal_stream), threading.Thread(target=poll_health)]
    for t in threads:
        t.start()
    if not started.wait(120):
        stop.set()
        raise RuntimeError(f"the normal stream did not start: {normal_error}")
    results: dict = {}
    t_abuse = time.perf_counter()
    chat_first: list[float] = []  # when the chat's first chunk came (its prefill's end)

    def chat_stream(c):
        for i, _ in enumerate(c.stream(_request(None, 8, messages=chat), timeout=300)):
            if i == 0:
                chat_first.append(time.perf_counter() - t_abuse)

    chars = int(args.prompt_mb * (1 << 20))
    chat = [
        {"role": ("user", "assistant")[i % 2], "content": f"message {i}: " + "w" * 24}
        for i in range(args.chat_messages)
    ]
    calls = {
        f"prompt_{args.prompt_mb:g}mb": lambda c: _outcome(
            lambda: list(c.stream(_request("x" * chars, 4), timeout=120))
        ),
        f"chat_{args.chat_messages}_messages": lambda c: _outcome(lambda: chat_stream(c)),
        "stop_strings_100x10kb": lambda c: _outcome(
            lambda: list(c.stream(_request("hi", 4, stop=["s" * 10_000] * 100), timeout=60))
        ),
        "malformed_protobuf": lambda c: _outcome(lambda: _malformed(c)),
    }
    workers = []
    for name, call in calls.items():

        def work(name=name, call=call):
            with Client(address, options=own) as c:
                results[name] = call(c)

        workers.append(threading.Thread(target=work))
    idle = threading.Thread(target=lambda: results.update(idle_streams=_idle(address, args)))
    wire = threading.Thread(
        target=lambda: results.update(
            garbage_bytes=_garbage(address, False), garbage_h2_frames=_garbage(address, True)
        )
    )
    for t in (*workers, idle, wire):
        t.start()
    for t in (*workers, idle, wire):
        t.join(600)
    time.sleep(1.0)  # a second more of normal rounds after the last abuser
    stop.set()
    for t in threads:
        t.join(60)
    normal.close()
    return {
        "server": address,
        "normal_chunks": len(gaps) + len(first_chunk),
        "normal_worst_gap_ms": round(1000 * max(gaps), 1) if gaps else None,
        "normal_median_gap_ms": round(1000 * statistics.median(gaps), 1) if gaps else None,
        # the three worst, each with when it ended (seconds after the abuse began), and when
        # the chat's prefill ended (its first chunk)
        "normal_worst_gaps": ", ".join(
            f"{1000 * g:.0f} ms at {end - t_abuse:.1f} s"
            for g, end in sorted(zip(gaps, gap_ends), reverse=True)[:3]
        ),
        "chat_first_chunk_s": round(chat_first[0], 2) if chat_first else None,
        "normal_worst_first_chunk_ms": round(1000 * max(first_chunk), 1),
        "normal_error": normal_error[0] if normal_error else None,
        "health_checks": health["checks"],
        "health_not_serving": health["not_serving"],
        "health_worst_ms": round(health["worst_ms"], 1),
        **results,
    }


def _request(prompt, max_tokens: int, **kw):
    from ..api.client import make_request

    return make_request(prompt, max_tokens=max_tokens, use_cache=False, **kw)


def _outcome(call) -> str:
    """'OK in 1.2 s' or 'INVALID_ARGUMENT in 0.05 s: <details>'."""
    import grpc

    t0 = time.perf_counter()
    try:
        call()
        status = "OK"
    except grpc.RpcError as exc:
        status = f"{exc.code().name}: {(exc.details() or '')[:90]}"
    took = time.perf_counter() - t0
    head, _, tail = status.partition(": ")
    return f"{head} in {took:.2f} s" + (f": {tail}" if tail else "")


def _malformed(client) -> None:
    rpc = client.channel.unary_stream(
        "/sanctum.v1.Inference/Generate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    list(rpc(b"\xff\xff\xff\xff\x0f not a GenerateRequest", timeout=30))


def _idle(address: str, args) -> str:
    """Idle reflection streams on their own connections: what each ended with."""
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    held = []
    for _ in range(args.idle_streams):
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        requests: queue.Queue = queue.Queue()
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(requests.get, None)
        )
        held.append((channel, call))
    t0 = time.perf_counter()
    ends: dict[str, int] = {}
    for channel, call in held:
        try:
            next(iter(call))
            status = "a response?"
        except grpc.RpcError as exc:
            status = exc.code().name
        except StopIteration:
            status = "OK"
        ends[status] = ends.get(status, 0) + 1
        channel.close()
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(ends.items()))
    return f"{statuses} (closed by the server after {time.perf_counter() - t0:.1f} s idle)"


def _garbage(address: str, framed: bool) -> str:
    """Bytes that are not HTTP/2, or the HTTP/2 preface then a HEADERS frame whose header block
    is garbage: what the server does with the connection."""
    host, port = address.rsplit(":", 1)
    junk = os.urandom(4096)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        if framed:
            settings = struct.pack(">I", 0)[1:] + bytes([4, 0]) + struct.pack(">I", 0)
            headers = struct.pack(">I", 64)[1:] + bytes([1, 4]) + struct.pack(">I", 1) + junk[:64]
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings + headers)
        else:
            s.sendall(junk)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
    return _describe_h2(data) + ", connection closed by the server"


_H2_ERRORS = [
    "NO_ERROR",
    "PROTOCOL_ERROR",
    "INTERNAL_ERROR",
    "FLOW_CONTROL_ERROR",
    "SETTINGS_TIMEOUT",
    "STREAM_CLOSED",
    "FRAME_SIZE_ERROR",
    "REFUSED_STREAM",
    "CANCEL",
    "COMPRESSION_ERROR",
    "CONNECT_ERROR",
    "ENHANCE_YOUR_CALM",
]


def _describe_h2(data: bytes) -> str:
    """The server's answer among its frames: GOAWAY (the connection) or RST_STREAM (the
    stream), with its error code."""
    i, answer = 0, "no GOAWAY or RST_STREAM"
    while i + 9 <= len(data):
        length, kind = int.from_bytes(data[i : i + 3], "big"), data[i + 3]
        payload = data[i + 9 : i + 9 + length]
        if kind in (3, 7) and len(payload) >= 4:  # RST_STREAM: the code; GOAWAY: stream, code
            code = int.from_bytes(payload[-4:] if kind == 3 else payload[4:8], "big")
            name = _H2_ERRORS[code] if code < len(_H2_ERRORS) else str(code)
            answer = f"{'RST_STREAM' if kind == 3 else 'GOAWAY'} {name}"
            if kind == 7:
                break
        i += 9 + length
    return answer

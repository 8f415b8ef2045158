"""The serve stage: bind, serve, prove /health, then READY=1; drain on SIGTERM.

::

    bind serve.host:serve.port (our socket: a busy port fails the stage before anything else)
      -> engine thread (BatchLoop) started, uvicorn serving on the socket (no signal handlers of
         its own: the lifecycle's handlers set ctx.shutdown)
      -> /health asked over the socket -> 200 -> READY=1 + STATUS, watchdog started
      -> ... serve until ctx.shutdown ...
      -> STOPPING=1, /health 503, listening socket closed, in-flight requests finish within
         serve.shutdown_grace_s (then uvicorn cancels them and their sequences are freed)
      -> engine thread stopped; with serve.prefix_cache_dir the prefix cache's blocks still
         in memory are written to disk until stop_timeout_s - stop_margin_s (save_prefix_cache)
      -> close() frees the socket, the loop, the service
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

from moe_service.errors import StageError
from moe_service.log import get_logger
from moe_service.notify import start_watchdog
from moe_service.sizes import GiB
from pipeline.context import PipelineContext
from pipeline.spec import Stage, register_stage

if TYPE_CHECKING:
    from fastapi import FastAPI

    from moe_service.engine.batch import BatchLoop
    from moe_service.engine.engine import Engine
    from moe_service.server import Service

log = get_logger(__name__)

HEALTH_CHECK_TIMEOUT_S = 10.0
HTTP_LOOP_STALL_S = 10.0
"""The event loop serving HTTP must run at least this often; longer, the watchdog stops
pinging (its /health could not answer anyway)."""


class LoopHeartbeat:
    """The HTTP event loop's own liveness, as a Liveness check.

    The serve stage's coroutine calls :meth:`beat` every 0.1 s on the event loop; the watchdog
    thread calls :meth:`check`, which names the stall once the last beat is older than
    ``stall_s`` seconds (a handler or a library call that blocks the loop: then /health cannot
    answer either, so only the watchdog can tell systemd)."""

    def __init__(self, stall_s: float = HTTP_LOOP_STALL_S) -> None:
        self.stall_s = stall_s
        self.last_s = time.monotonic()

    def beat(self) -> None:
        self.last_s = time.monotonic()

    def check(self) -> str | None:
        late_s = time.monotonic() - self.last_s
        return f"the HTTP event loop has not run for {late_s:.1f} s" if late_s > self.stall_s else None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port), non-blocking.

    Raises StageError naming the address (errno kept in ``.errno``) when it cannot be bound.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StageError(f"serve.host = {host!r} does not resolve: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        err = StageError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}")
        err.errno = e.errno
        raise err from None
    return sock


def local_address(sock: socket.socket) -> tuple[str, int]:
    """(host to connect to, port) of a listening socket: wildcard addresses become loopback."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, port


async def fetch_health(host: str, port: int, timeout_s: float = HEALTH_CHECK_TIMEOUT_S) -> tuple[int, bytes]:
    """GET /health over a fresh connection: (status code, body). Raises OSError/TimeoutError."""

    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        head, _, body = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
        return status, body

    return await asyncio.wait_for(go(), timeout_s)


def header_timeout_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a deadline for request headers: a connection must complete
    a request's headers within ``header_timeout_s`` of opening, and of each response on a
    kept-alive connection, else it is closed. uvicorn's own timeout_keep_alive starts only
    after a response and is reset by every byte, so a client trickling header bytes (or
    sending none) would hold a connection, and a place under limit_concurrency, forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None
        _timer_cycle = None

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._timer_cycle = self.cycle
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._timer_cycle and not self.transport.is_closing():
                log.info("http_header_timeout", client=self.client, timeout_s=header_timeout_s)
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.cycle is not self._timer_cycle:
                self._disarm_header_timer()  # a request's headers arrived

        def on_response_complete(self) -> None:
            before = self.cycle
            super().on_response_complete()
            if self.cycle is before and not self.transport.is_closing():
                self._arm_header_timer()  # waiting for the next request's headers

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol


def _uvicorn_server(app, grace_s: float, *, max_connections: int | None = None, keepalive_timeout_s: int = 5,
                    header_timeout_s: float | None = None):
    """uvicorn over ``app``: ``max_connections`` is its limit_concurrency (503 beyond),
    ``keepalive_timeout_s`` its timeout_keep_alive; ``header_timeout_s`` adds the header
    deadline of :func:`header_timeout_protocol`."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its own signal handlers: the lifecycle owns SIGTERM/SIGINT."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    http = header_timeout_protocol(header_timeout_s) if header_timeout_s else "h11"
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", http=http, ws="none",
                            timeout_graceful_shutdown=grace_s,  # type: ignore[arg-type]  # a float works (asyncio.wait_for)
                            server_header=False, limit_concurrency=max_connections, timeout_keep_alive=keepalive_timeout_s)
    return Server(config)


def _on_sighup(keys):
    """SIGHUP rereads serve.api_key_file (when set); returns the previous handler to restore,
    or None when no handler was installed (no key file, or not the main thread)."""
    if keys.key_file is None or threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        log.info("sighup_received", action="reload serve.api_key_file")
        keys.reload()

    return signal.signal(signal.SIGHUP, handler)


def make_prefix_cache(engine, cfg, metrics, settings=None):
    """The prefix cache (engine/prefix.py) over the engine's KV cache, with
    serve.prefix_cache_gib of host memory; None when that is 0, the KV cache is on a torch
    device or holds per-sequence state that declares no snapshot kind (said in the log; a
    model whose state declares it, deepseek4, gets a prefix cache that restores it). With
    serve.prefix_cache_dir (and ``settings``, the whole config: the model file and
    engine.kv_type key the store), a disk store behind it (:func:`make_prefix_store`)."""
    from moe_service.engine.prefix import PrefixCache

    if cfg.prefix_cache_gib <= 0:
        log.info("prefix_cache_off", reason="serve.prefix_cache_gib = 0")
        return None
    kv = engine.model.kv
    if not getattr(kv, "host_rows", False):
        log.info("prefix_cache_off", reason="the KV cache is on a torch device (the prefix cache runs on the CPU path)")
        return None
    why = kv.state_restorable if getattr(kv, "state", None) else None
    if why:
        log.info("prefix_cache_off", reason=why)
        return None
    pc = PrefixCache(kv, int(cfg.prefix_cache_gib * GiB), metrics=metrics)
    if settings is not None:
        pc.store = make_prefix_store(settings, engine, pc.block_tokens)
    log.info("prefix_cache_on", budget_bytes=pc.budget_bytes, block_tokens=pc.block_tokens, block_bytes=pc.block_bytes,
             state=pc.stateful, disk_dir=str(pc.store.dir) if pc.store is not None else None)
    return pc


def make_prefix_store(settings, engine, block_tokens: int):
    """The prefix cache's disk store (engine/prefix_store.py) in serve.prefix_cache_dir, up to
    serve.prefix_cache_disk_gib; None when the setting is empty, or when the directory cannot
    be made or the model file read (logged: the cache then stays in memory, the service starts)."""
    from moe_service.engine.prefix_store import PrefixStore, resolve_store_dir, store_identity

    root = resolve_store_dir(settings.serve.prefix_cache_dir)
    if root is None:
        return None
    kv = engine.model.kv
    try:
        identity = store_identity(model_path=settings.model_path(), kv_type=settings.engine.kv_type,
                                  n_ctx=engine.n_ctx, block_tokens=block_tokens, token_bytes=kv.token_bytes(),
                                  arch=str(getattr(getattr(engine.model, "params", None), "arch", "") or ""))
        return PrefixStore(root, identity, int(settings.serve.prefix_cache_disk_gib * GiB))
    except OSError as e:
        log.error("prefix_store_off", dir=str(root), error=str(e),
                  reason="serve.prefix_cache_dir cannot be used: the prefix cache stays in memory only")
        return None


def save_prefix_cache(pc, cfg, stop_t0: float) -> None:
    """At shutdown, once the engine thread stopped: write the prefix cache's blocks still in
    memory to its disk store, until serve.stop_timeout_s - serve.stop_margin_s after the stop
    began at ``stop_t0`` (time.monotonic()); the margin stays for closing the stages."""
    if pc is None or pc.store is None:
        return
    deadline = stop_t0 + cfg.stop_timeout_s - cfg.stop_margin_s
    try:
        pc.persist(deadline)
    except Exception as e:  # the stop goes on: a cache that is not saved is only slower next time
        log.error("prefix_store_save_failed", error=f"{type(e).__name__}: {e}")


@register_stage
class ServeStage(Stage):
    """Serve the OpenAI-compatible API until shutdown (see module doc)."""

    name = "serve"
    requires = ("warmup",)
    reads = ("engine",)
    writes = ("server",)
    summary = ("binds serve.host:serve.port, runs the engine loop and the HTTP API, "
               "sends READY=1 once /health answers 200, drains in-flight requests on SIGTERM")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.batch: BatchLoop | None = None
        self.service: Service | None = None
        self.url = ""
        self.stop_t0: float | None = None  # time.monotonic() when the stop began (SIGTERM seen)

    def run(self, ctx: PipelineContext) -> None:
        from moe_service.engine.batch import BatchLoop
        from moe_service.metrics import Metrics
        from moe_service.server import Service, create_app

        cfg = ctx.config.serve
        engine = ctx.engine
        if engine is None:
            raise StageError("serve needs ctx.engine, which the engine stage builds")
        from moe_service.api.auth import ApiKeyFileError, ApiKeys, warn_if_open

        try:
            keys = ApiKeys([k.get_secret_value() for k in cfg.api_keys], cfg.api_key_file or None)
        except ApiKeyFileError as e:
            raise StageError(str(e)) from None
        warn_if_open(cfg.host, keys)
        self.sock = bind_socket(cfg.host, cfg.port)
        host, port = local_address(self.sock)
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        log.info("serve_listening", host=cfg.host, port=port, url=self.url)
        metrics = Metrics()
        metrics.attach_context(ctx)
        prefix_cache = make_prefix_cache(engine, cfg, metrics, ctx.config)
        batch = self.batch = BatchLoop(engine, parallel=cfg.parallel, queue_size=cfg.queue_size,
                                       retry_after_s=cfg.retry_after_s, liveness=ctx.liveness, metrics=metrics,
                                       max_failed_steps=cfg.max_failed_steps, stall_s=cfg.engine_stall_s,
                                       prefix_cache=prefix_cache).start()
        service = self.service = Service(engine=engine, batch=batch, metrics=metrics,
                                         model_name=engine.model_name, stage=lambda: ctx.current_stage,
                                         keys=keys if keys.enabled else None, metrics_auth=cfg.metrics_auth,
                                         allowed_hosts=tuple(cfg.allowed_hosts), cors_origins=tuple(cfg.cors_origins),
                                         model_aliases=tuple(cfg.model_aliases))
        service.max_tokens_policy = cfg.max_tokens_policy
        service.max_body_bytes = cfg.max_body_bytes or None
        service.body_timeout_s = cfg.body_timeout_s
        from moe_service.api.response_store import ResponseStore

        service.responses_store = ResponseStore(int(cfg.responses_store_mib * (1 << 20)))
        ctx.server = service
        app = create_app(service)
        previous = _on_sighup(keys)
        try:
            asyncio.run(self._serve(ctx, app, (host, port), engine, batch, service))
        finally:
            if previous is not None:
                signal.signal(signal.SIGHUP, previous)
        batch.stop()
        if ctx.shutdown.is_set():  # a stop, drained: the disk store keeps the cache for the next start
            save_prefix_cache(prefix_cache, cfg, self.stop_t0 or time.monotonic())

    async def _serve(self, ctx: PipelineContext, app: FastAPI, addr: tuple[str, int], engine: Engine,
                     batch: BatchLoop, service: Service) -> None:
        cfg = ctx.config.serve
        server = _uvicorn_server(app, cfg.shutdown_grace_s, max_connections=cfg.max_connections,
                                 keepalive_timeout_s=cfg.keepalive_timeout_s, header_timeout_s=cfg.header_timeout_s)
        task = asyncio.create_task(server.serve(sockets=[self.sock] if self.sock is not None else None))
        while not server.started:
            if task.done():
                task.result()
                raise StageError(f"the HTTP server stopped during startup on {self.url}")
            await asyncio.sleep(0.01)
        service.ready = True
        try:
            status, body = await fetch_health(*addr)
        except (OSError, TimeoutError) as e:
            await self._stop_server(server, task)
            raise StageError(f"serve: {self.url}/health did not answer: {e}") from None
        if status != 200:
            await self._stop_server(server, task)
            raise StageError(f"serve: {self.url}/health answered {status}: {body[:200]!r}")
        ctx.notifier.ready(f"serving {service.model_name} on {self.url}")
        log.info("service_ready", url=self.url, model=service.model_name, parallel=cfg.parallel,
                 n_ctx=engine.n_ctx, stage_durations_s={k: round(v, 3) for k, v in ctx.stage_durations_s.items()})
        heartbeat = LoopHeartbeat()
        ctx.liveness.add_check("http", heartbeat.check)
        watchdog = start_watchdog(ctx.notifier, ctx.liveness)
        try:
            while not ctx.shutdown.is_set() and not task.done():
                await asyncio.sleep(0.1)
                heartbeat.beat()
            if task.done():
                task.result()
                raise StageError(f"the HTTP server on {self.url} stopped on its own")
            t0 = self.stop_t0 = time.monotonic()
            ctx.notifier.stopping(f"stopping: finishing {batch.active + batch.waiting} request(s)")
            log.info("serve_stopping", signal=ctx.shutdown_signal, active=batch.active,
                     queued=batch.waiting, grace_s=cfg.shutdown_grace_s)
            service.stopping = True
            await self._stop_server(server, task)
            log.info("serve_stopped", seconds=round(time.monotonic() - t0, 3))
        finally:
            watchdog.stop()
            ctx.liveness.remove_check("http")

    @staticmethod
    async def _stop_server(server, task) -> None:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def close(self, ctx: PipelineContext) -> None:
        if self.batch is not None:
            self.batch.stop()
            self.batch = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.service is not None:
            self.service.ready = False
            self.service.stopping = True
        ctx.server = None

"""`neuron-moe serve`: check the arguments, resolve the artifacts, run uvicorn.

What can be checked before loading (port file, backend, artifact path and its tokenizer's
digests, Neuron SDK or S3 support present, the checkpoint, --max-model-len) fails before the
socket is bound, as one `error:` line. The model then loads in a thread — pulling an s3://
artifact first (where another server is pulling it into the same cache: waiting for that pull,
then verifying its files) — and warms up (`ready.py`) while /health answers 503; a load that
fails stops the server with that error (exit 2), so a container restarts.

The socket is bound before anything loads (an address in use is one `error:` line). A client
must send a request's headers within --header-timeout and its body within --body-timeout.

SIGTERM (or Ctrl-C) drains: uvicorn stops accepting connections and waits up to
--drain-timeout for the requests in flight to finish, new requests on open connections get
503 + Retry-After, and the process exits 0. A request still running at the deadline is ended
properly (a stream: an error event, then [DONE]; a plain request, or one whose body is still
arriving: a 503 JSON body), and uvicorn is given DRAIN_GRACE_S more to send those endings before it
cuts connections itself. The engine's threads are stopped before the process exits (a thread inside
torch at exit would abort it).
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import socket
from pathlib import Path

import uvicorn

from .. import hub
from ..errors import UserError
from ..neuron.artifact import check_target, check_tokenizer
from ..neuron.artifact import verify as verify_artifact
from ..port import DTYPES, load_port, with_shapes
from ..publish import s3
from ..run_config import RunConfig, Serving
from ..spec import COMPILED, MODULES, compile_cache
from ..hub import check_assistant
from ..static import inductor
from ..static.cache import cache_bytes, cache_layout
from . import connection, neuron, ready
from .app import BODY_TIMEOUT_S, MAX_BODY_BYTES, create_app
from .backends import load_engine

log = logging.getLogger("neuron_moe.serve")
S3_SCHEME = "s3://"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
DRAIN_GRACE_S = 5.0
# Servers sharing an --artifacts-cache: one pulls, the others wait for as long as its bytes keep
# landing, up to this long without a byte (it may be hashing the files already there), then
# verify what it pulled.
SHARED_PULL_STALL_S = 600.0


class ServeError(UserError):
    pass


def s3_pull_function():
    """`publish.s3.pull(uri, dest_dir)`, once its S3 client (boto3, the publish extra) is known to be
    installed: an s3:// URI without it fails before the model loads."""
    if importlib.util.find_spec("boto3") is None:
        raise ServeError("--artifacts s3://... needs the 'boto3' package: pip install 'neuron-moe[publish]'")
    return s3.pull


def s3_cache_dir(uri: str, root: Path) -> Path:
    """Where --artifacts-cache `root` holds the publication at `uri`: a folder per bucket and prefix
    segment (`s3.parse_uri` refuses a bucket or a segment of '.' or '..', which would leave `root`)."""
    bucket, prefix = s3.parse_uri(uri)
    return root.joinpath(bucket, *prefix.split("/") if prefix else ())


def artifacts_dir(serving: Serving) -> tuple[Path | None, object]:
    """(the local directory of --artifacts, the pull that fills it first or None): an s3:// URI's
    folder in --artifacts-cache, else the directory given (None: no --artifacts)."""
    artifacts = serving.artifacts
    if artifacts and artifacts.startswith(S3_SCHEME):
        pull = s3_pull_function()
        return s3_cache_dir(artifacts, Path(serving.artifacts_cache).expanduser()), pull
    if artifacts and not Path(artifacts).is_dir():
        raise ServeError(f"--artifacts {artifacts}: not a directory")
    return (Path(artifacts) if artifacts else None), None


def check_batching_flags(config: RunConfig) -> None:
    """The flags of one kind of backend refused with another: --max-running is transformers' model's
    rows, the shapes and prefix caching the batching backends' (an artifact's shapes are its own)."""
    backend, caching = config.backend, config.serving.prefix_caching
    if backend.graphs in (MODULES, COMPILED) and config.serving.max_running is not None:
        raise ServeError(
            f"--backend {backend.name} batches: it runs as many requests at once as its graphs have "
            f"rows{' (--batch-size)' if backend.graphs == MODULES else ''}; --max-running is for the "
            f"backends over transformers' model"
        )
    caching_flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    for flag, value in (*config.shapes.given().items(), (caching_flag, caching)):
        if value is None or backend.graphs == MODULES or (backend.graphs == COMPILED and flag == caching_flag):
            continue
        takes = (
            "takes its shapes from the artifact's manifest"
            if backend.graphs == COMPILED
            else "runs transformers' model (its rows: --max-running)"
        )
        raise ServeError(f"{flag} shapes --backend static's graphs; --backend {backend.name} {takes}")


def plan_load(config: RunConfig, stopper: ready.Stopper | None = None):
    """(port, load) where load() -> Engine; raises ServeError for what is wrong up front. `stopper`
    stops load()'s warm-up when the server exits."""
    serving = config.serving
    if not serving.host.strip():  # uvicorn and the socket would take it for every address, unsaid
        raise ServeError(
            f"--host {serving.host!r} is no address: pass 127.0.0.1 (this machine only, the default) or "
            "0.0.0.0 / :: (every address)"
        )
    port = load_port(config.model)
    local, pull = artifacts_dir(serving)
    checkpoint, manifest = config.checkpoint, None
    if config.revision is not None and checkpoint is None:
        raise ServeError("--revision picks the revision of --checkpoint ORG/NAME: pass --checkpoint too")
    backend, caching = config.backend, serving.prefix_caching  # a spec.serve_backends entry in its format
    check_batching_flags(config)
    if config.speculative is not None and backend.graphs != MODULES:
        built = " (an artifact speculates as trace-and-compile --speculative-config built it)"
        raise ServeError(
            f"--speculative-config runs in --backend static's graphs, not --backend {backend.name}"
            + (built if backend.graphs == COMPILED else "")
        )
    if config.speculative is not None:  # its assistant found and fitting before anything loads
        check_assistant(config.speculative, port.config)
    if backend.graphs == MODULES:
        port = with_shapes(port, config.shapes)  # the graphs' shapes: the port's [static], the flags over it
        check_static_memory(port, DTYPES[backend.dtype] if backend.dtype else port.dtype, caching is not False)
    if backend.graphs == COMPILED:
        if local is None:
            raise ServeError("--backend neuron needs --artifacts DIR|s3://... (the trace-and-compile output)")
        if pull is None:  # the artifact checked whole, whatever the runtime (s3: once pulled)
            manifest = verify_artifact(local, port)
            check_target(manifest, local)  # compiled for this version's target (s3: by the runtime once pulled)
            if checkpoint is None:  # it serves with its own tokenizer: one it carries
                check_tokenizer(local, manifest, port)
        neuron.require_sdk()
    elif local is not None:  # for a CPU backend the artifact is an HF-layout checkpoint
        if checkpoint is not None:
            raise ServeError("give the CPU backend's weights once: --checkpoint or --artifacts, not both")
        checkpoint = local if pull is None else None
    if checkpoint is not None:  # the checkpoint check every command makes, before binding (a Hub id: downloaded)
        checkpoint = hub.local_checkpoint(checkpoint, config.revision, port)
    context = _context(backend, port, manifest)
    if context is not None:  # an s3:// artifact's is known once it is pulled: checked then
        ready.check_max_model_len(serving.max_model_len, *context)
    compiles = check_compile(config)

    def load():
        nonlocal checkpoint
        if pull is not None:
            log.info("pulling %s into %s", serving.artifacts, local)
            pull(serving.artifacts, local, stall_s=SHARED_PULL_STALL_S)
            if backend.graphs != COMPILED:
                checkpoint = local
            else:
                verify_artifact(local, port)
        engine = load_engine(
            port,
            backend,
            checkpoint=checkpoint,
            artifacts=local,
            dtype=DTYPES[backend.dtype] if backend.dtype else None,
            compile=compiles,
            progress=log.info,
            prefix_caching=caching,
            rows=serving.max_running,
            speculative=config.speculative,
        )
        found = neuron.read_manifest(local) if backend.graphs == COMPILED else None
        dtype = found["dtype"] if found else str(backend.dtype or port.dtype).removeprefix("torch.")
        banner = ready.Banner(port.name, tuple(served_names(config, port)), backend.name, dtype)
        return ready.ready(engine, banner, serving.max_model_len, _context(backend, port, found)[1], stopper)

    return port, load


def check_compile(config: RunConfig) -> bool:
    """Whether the static graphs are compiled (--backend static without --no-compile); when they are,
    a C++ compiler is found and --compile-cache made inductor's cache, else one error says why. The
    compile flags are refused where no graphs are compiled here."""
    backend = config.backend
    given = [
        flag
        for flag, value in (("--no-compile", config.compile is False), ("--compile-cache", config.compile_cache))
        if value
    ]
    if given and backend.graphs != MODULES:
        runs = (
            "runs the artifact's graphs, compiled by trace-and-compile"
            if backend.graphs == COMPILED
            else "runs transformers' model, uncompiled"
        )
        raise ServeError(f"{given[0]} applies to --backend static's graphs; --backend {backend.name} {runs}")
    if len(given) == 2:
        raise ServeError("--compile-cache keeps compiled graphs; with --no-compile none are compiled")
    if backend.graphs != MODULES or config.compile is False:
        return False
    inductor.require_compiler()
    inductor.use_cache_dir(compile_cache(config.compile_cache))
    return True


def served_names(config: RunConfig, port) -> list[str]:
    """`--served-model-name`: the names requests may give as `model` (responses carry the first);
    default the port's name."""
    return list(config.serving.served_model_name or [port.name])


def _context(backend, port, manifest: dict | None) -> tuple[int, str] | None:
    """(the context in tokens the backend holds, what holds it); None while an artifact is unread.
    A prompt of n tokens and its new tokens take n + max_tokens - 1 cache positions."""
    if backend.graphs == COMPILED:
        return None if manifest is None else (manifest["max_cache_len"] + 1, "the artifact (max_cache_len + 1)")
    if backend.graphs == MODULES:
        return port.static.max_cache_len + 1, "the static graphs ([static] max_cache_len + 1)"
    return port.config.max_position_embeddings, "the model (max_position_embeddings)"


def available_memory() -> int:
    """Memory this process can allocate now without swapping: the kernel's MemAvailable, or what a
    container's limit leaves when that is less (cgroup v2)."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    free = int(meminfo["MemAvailable"].split()[0]) * 1024
    try:
        limit, used = (Path("/sys/fs/cgroup", f).read_text().strip() for f in ("memory.max", "memory.current"))
    except OSError:
        return free
    return min(free, int(limit) - int(used)) if limit.isdigit() and used.isdigit() else free


def check_static_memory(port, dtype, whole_rows: bool = True) -> None:
    """The static runtime's KV cache (allocated at load; `whole_rows`: the layout prefix caching
    needs, `static/cache.py`) and one step's logits [B, V] fp32, against
    the memory available: a batch that cannot fit is refused before binding, not by a failed
    allocation (or the OOM killer) once the server is up."""
    spec = port.static_spec("--backend static")
    rows = spec.batch_size
    cache = cache_bytes(cache_layout(port.config, spec.max_cache_len, whole_rows), rows, dtype)
    logits = rows * port.config.vocab_size * 4
    free = available_memory()
    if cache + logits > free:
        raise ServeError(
            f"--batch-size {rows}: the static graphs' KV cache ({cache / 2**30:,.1f} GiB) and one "
            f"step's logits ({logits / 2**30:,.1f} GiB) need more than the {free / 2**30:,.1f} GiB "
            f"of memory available"
        )


class DrainingServer(uvicorn.Server):
    """uvicorn, its graceful shutdown DRAIN_GRACE_S longer than the app's own drain deadline."""

    def __init__(self, uvicorn_config: uvicorn.Config, drain_timeout: float):
        uvicorn_config.timeout_graceful_shutdown = drain_timeout + DRAIN_GRACE_S
        super().__init__(uvicorn_config)
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig, frame):
        self.config.app.state.server.drain(self.drain_timeout)
        log.info("signal %d: draining the requests in flight (up to %g s), then exiting", sig, self.drain_timeout)
        super().handle_exit(sig, frame)


def bind(host: str, tcp_port: int) -> socket.socket:
    """The listening socket, bound before anything loads (as uvicorn would bind it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, tcp_port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{tcp_port}: {e.strerror or e}") from None
    return sock


def make_app(config: RunConfig, on_load_error=None):
    """The application `serve` runs, every check of `plan_load` made; the model loads once it starts."""
    stopper = ready.Stopper()
    port, load = plan_load(config, stopper)
    serving = config.serving
    app = create_app(
        load,
        model_name=served_names(config, port),
        api_key=serving.api_key,
        max_running=serving.max_running,
        max_queue=serving.max_queue,
        max_body_bytes=serving.max_body_bytes or MAX_BODY_BYTES,
        vocab_size=port.config.vocab_size,
        body_timeout=serving.body_timeout or BODY_TIMEOUT_S,
        on_load_error=on_load_error,
    )
    app.state.warm_up = stopper  # run() stops a warm-up still running when the server exits
    return app


def run(config: RunConfig) -> int:
    serving = config.serving
    logging.basicConfig(level=serving.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    failure: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failure.append(e)
        server.should_exit = True

    app = make_app(config, on_load_error)
    if serving.host not in LOOPBACK and not serving.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", serving.host)
    uvicorn_config = uvicorn.Config(
        app,
        host=serving.host,
        port=serving.tcp_port,
        log_level=serving.log_level,
        lifespan="on",
        http=connection.protocol(serving.header_timeout or connection.HEADER_TIMEOUT_S),
    )
    server = DrainingServer(uvicorn_config, serving.drain_timeout)
    sock = bind(serving.host, serving.tcp_port)
    # uvicorn logs this line itself only for a socket it binds (the entrypoint's users read the port in it)
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", *sock.getsockname()[:2]
    )
    # uvicorn re-raises the signal it drained on once it is done; with the default handlers
    # that would kill a cleanly drained process (SIGTERM) or print a traceback (SIGINT).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        app.state.warm_up.stop()  # not minutes more of compiling before the exit
        app.state.scheduler.close()  # the requests still running end (uvicorn's own shutdown may be cut short)
        app.state.server.close()  # and the engine's threads stop
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure and not isinstance(failure[0], ready.Stopped):  # stopped: by the exit, as it was told to
        if isinstance(failure[0], UserError):
            raise ServeError(f"the model failed to load: {failure[0]}")
        raise failure[0]
    return 0

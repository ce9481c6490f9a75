"""`neuron-moe serve`: check the arguments, resolve the artifacts, run uvicorn.

What can be checked before loading (port file, backend, artifact path, Neuron SDK or S3
support present) fails before the socket is bound, as one `error:` line. The model then
loads in a thread — pulling an s3:// artifact first — while /health answers 503; a load
that fails stops the server with that error (exit 2), so a container restarts.

SIGTERM (or Ctrl-C) drains: uvicorn stops accepting connections and waits up to
--drain-timeout for the requests in flight to finish, new requests on open connections get
503 + Retry-After, and the process exits 0. A request still running at the deadline is ended
properly (a stream: an error event, then [DONE]; a plain request: a 503 JSON body), and uvicorn
is given DRAIN_GRACE_S more to send those endings before it cuts connections itself.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
from pathlib import Path

import uvicorn

from ..checkpoint import read_config
from ..errors import UserError
from ..port import DTYPES, load_port
from ..publish import s3
from . import neuron
from .app import MAX_BODY_BYTES, create_app
from .backends import STATIC, load_engine

log = logging.getLogger("neuron_moe.serve")
S3_SCHEME = "s3://"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
DRAIN_GRACE_S = 5.0


class ServeError(UserError):
    pass


def s3_pull_function():
    """`publish.s3.pull(uri, dest_dir)`, once its S3 client (boto3, the publish extra) is known to be
    installed: an s3:// URI without it fails before the model loads."""
    if importlib.util.find_spec("boto3") is None:
        raise ServeError("--artifacts s3://... needs the 'boto3' package: pip install 'neuron-moe[publish]'")
    return s3.pull


def s3_cache_dir(uri: str, root: Path) -> Path:
    bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise ServeError(f"--artifacts {uri}: no bucket in the URI (expected s3://bucket/prefix)")
    return root.joinpath(bucket, *[p for p in prefix.split("/") if p not in ("", ".", "..")])


def plan_load(args):
    """(port, load) where load() -> Engine; raises ServeError for what is wrong up front."""
    port = load_port(args.model)
    if args.max_queue < 0:
        raise ServeError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if args.drain_timeout < 0:
        raise ServeError(f"--drain-timeout must be 0 or more, got {args.drain_timeout}")
    artifacts, pull = args.artifacts, None
    if artifacts and artifacts.startswith(S3_SCHEME):
        pull = s3_pull_function()
        local = s3_cache_dir(artifacts, Path(args.artifacts_cache).expanduser())
    elif artifacts:
        local = Path(artifacts)
        if not local.is_dir():
            raise ServeError(f"--artifacts {artifacts}: not a directory")
    else:
        local = None

    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    batching = args.backend in (STATIC, "neuron")
    if batching and args.max_running is not None:
        raise ServeError(f"--backend {args.backend} batches: it runs as many requests at once as its graphs have "
                         f"rows{' (--batch-size)' if args.backend == STATIC else ''}; --max-running is for the "
                         f"per-request backends")
    for flag, value in (("--batch-size", args.batch_size), ("--prefill-rows", args.prefill_rows),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and args.backend != STATIC:
            raise ServeError(f"{flag} shapes --backend static's graphs; --backend {args.backend} "
                             + ("takes its shapes from the artifact's manifest" if args.backend == "neuron"
                                else "runs one request per thread (--max-running)"))
    if args.backend == STATIC:
        spec = port.static_spec("--backend static")
        if args.prefill_chunk is not None and args.prefill_chunk not in spec.buckets:
            raise ServeError(f"--prefill-chunk {args.prefill_chunk} is not one of the port's buckets "
                             f"{list(spec.buckets)}")
    if args.backend == "neuron":
        if local is None:
            raise ServeError("--backend neuron needs --artifacts DIR|s3://... (the trace-and-compile output)")
        if pull is None:
            neuron.read_manifest(local)
        neuron.require_sdk()
    elif local is not None:  # for a CPU backend the artifact is an HF-layout checkpoint
        if checkpoint is not None:
            raise ServeError("give the CPU backend's weights once: --checkpoint or --artifacts, not both")
        checkpoint = local if pull is None else None
    if checkpoint is not None:  # a checkpoint of another model, or a broken config, fails now, not after binding
        read_config(checkpoint, port.config, port.name)

    def load():
        nonlocal checkpoint
        if pull is not None:
            log.info("pulling %s into %s", artifacts, local)
            pull(artifacts, local)
            if args.backend != "neuron":
                checkpoint = local
        return load_engine(port, args.backend, checkpoint=checkpoint, artifacts=local,
                           dtype=DTYPES[args.dtype] if args.dtype else None, batch_size=args.batch_size,
                           prefill_rows=args.prefill_rows, prefill_chunk=args.prefill_chunk)

    return port, load


class DrainingServer(uvicorn.Server):
    """uvicorn, its graceful shutdown DRAIN_GRACE_S longer than the app's own drain deadline."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float):
        config.timeout_graceful_shutdown = drain_timeout + DRAIN_GRACE_S
        super().__init__(config)
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig, frame):
        self.config.app.state.server.drain(self.drain_timeout)
        log.info("signal %d: draining the requests in flight (up to %g s), then exiting", sig, self.drain_timeout)
        super().handle_exit(sig, frame)


def run(args) -> int:
    port, load = plan_load(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if args.host not in LOOPBACK and not args.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    failure: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failure.append(e)
        server.should_exit = True

    app = create_app(load, model_name=port.name, api_key=args.api_key, max_running=args.max_running,
                     max_queue=args.max_queue, max_body_bytes=args.max_body_bytes or MAX_BODY_BYTES,
                     on_load_error=on_load_error)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on")
    server = DrainingServer(config, args.drain_timeout)
    # uvicorn re-raises the signal it drained on once it is done; with the default handlers
    # that would kill a cleanly drained process (SIGTERM) or print a traceback (SIGINT).
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        if isinstance(failure[0], UserError):
            raise ServeError(f"the model failed to load: {failure[0]}")
        raise failure[0]
    return 0


"""SageMaker's hosting contract, in the serving images: SageMaker runs a model's container as `docker
run IMAGE serve`, and docker/entrypoint.sh hands that `serve` here, which starts `neuron-moe serve` as
the contract asks:

  the model     SageMaker copies the model data (CreateModel's ModelDataSource or ModelDataUrl) to
                /opt/ml/model ($SM_MODEL_DIR where set); it must hold a trace-and-compile artifact,
                served with --backend neuron as the port its manifest names
  the TCP port  8080 ($SAGEMAKER_BIND_TO_PORT where SageMaker sets one), on every address ($HOST,
                default 0.0.0.0)
  the routes    GET /ping (503 while loading, 200 when ready) and POST /invocations (an OpenAI body:
                `messages` -> a chat completion, else a completion; serve/invocations.py)
  no API key    SageMaker authenticates invocations itself (IAM) and sends no Authorization header:
                a key ($NEURON_MOE_API_KEY, or --api-key among the serve flags) would refuse every
                invocation, so it is refused here
  the stop      SageMaker sends SIGKILL 30 s after SIGTERM: the drain timeout is DRAIN_TIMEOUT_S,
                which leaves uvicorn's own grace after it (serve/server.py) inside those 30 s

$NEURON_MOE_SERVE_ARGS adds serve flags (shell words, after these: a later flag wins), e.g.
`--served-model-name gemma --max-queue 64`. Not run on an endpoint (docs/deploy.md).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import cli
from ..errors import UserError
from ..neuron.artifact import read_manifest

MODEL_DIR = "/opt/ml/model"
TCP_PORT = 8080
DRAIN_TIMEOUT_S = 20.0  # + uvicorn's 5 s of grace, within SageMaker's 30 s before SIGKILL
EXTRA_ARGS = "NEURON_MOE_SERVE_ARGS"
NO_KEY = (
    "but SageMaker's invocations carry no bearer key (the endpoint's IAM policy authenticates them), so every "
    "one would be refused"
)


def serve_argv(environ: Mapping[str, str], extra: Sequence[str] = ()) -> list[str]:
    """`neuron-moe serve`'s arguments under SageMaker's environment `environ` (`extra`: the words after
    `serve` on the container's command line, appended)."""
    if environ.get("NEURON_MOE_API_KEY"):
        raise UserError(f"NEURON_MOE_API_KEY is set, {NO_KEY}: unset it in the model's Environment")
    try:
        more = shlex.split(environ.get(EXTRA_ARGS, ""))
    except ValueError as e:
        raise UserError(f"${EXTRA_ARGS}: {e}") from None
    for where, words in ((f"${EXTRA_ARGS}", more), ("the container's command line", extra)):
        if any(word == "--api-key" or word.startswith("--api-key=") for word in words):
            raise UserError(f"{where} sets --api-key, {NO_KEY}: leave it out")
    model_dir = Path(environ.get("SM_MODEL_DIR") or MODEL_DIR)
    if not model_dir.is_dir():
        raise UserError(
            f"{model_dir}: no such directory: SageMaker copies the model data there (CreateModel's "
            f"ModelDataSource or ModelDataUrl: a trace-and-compile artifact)"
        )
    manifest = read_manifest(model_dir)
    tcp_port = environ.get("SAGEMAKER_BIND_TO_PORT") or str(TCP_PORT)
    return [
        "serve",
        "--model",
        manifest["port"],
        "--backend",
        "neuron",
        "--artifacts",
        str(model_dir),
        "--host",
        environ.get("HOST") or "0.0.0.0",
        "--port",
        tcp_port,
        "--drain-timeout",
        f"{DRAIN_TIMEOUT_S:g}",
        *more,
        *extra,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = serve_argv(os.environ, sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())

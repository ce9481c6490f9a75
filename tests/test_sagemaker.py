"""SageMaker's hosting contract in the serving images (neuron_moe/deploy/sagemaker.py,
docker/entrypoint.sh, POST /invocations in serve/app.py): `docker run IMAGE serve` with SageMaker's
environment serves the artifact in the model directory on its port, and /ping and /invocations answer
as /health, /v1/completions and /v1/chat/completions do. The Neuron runtime is replaced by the CPU
graphs of the artifact's port (a dry-run artifact has no compiled model); nothing here runs on an
endpoint."""

import importlib.util
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from neuron_moe import cli
from neuron_moe.deploy import sagemaker
from neuron_moe.errors import UserError

from dockerfile import DOCKER
from serving import server_process, sse_events
from test_serve_neuron import dry_run_artifact  # noqa: F401 - the fixture: trace-and-compile --dry-run

REPO = Path(__file__).resolve().parents[1]

# What the child runs instead of `python3`: the Neuron runtime replaced by the CPU graphs of the
# artifact's port (as tests/test_serve_neuron.py does in-process), then the module it was asked for.
CPU_GRAPHS = """\
import runpy, sys
from neuron_moe.model import build_model
from neuron_moe.neuron import artifact
from neuron_moe.serve import backends, neuron
from neuron_moe.static.runtime import static_runtime

def runtime(artifacts, port, prefix_caching=None):
    manifest = artifact.read_manifest(artifacts)
    assert manifest["dry_run"] and manifest["port"] == port.name
    return static_runtime(build_model(port, port.static.decode_experts), port.static, manifest["batch_size"])

neuron.require_sdk = lambda: None
backends.neuron_runtime = runtime
assert sys.argv[1] == "-m", sys.argv
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def sagemaker_env(tmp_path, model_dir: Path, **more) -> dict:
    """The container's environment under SageMaker, `python3` being this interpreter with CPU graphs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "cpu_graphs.py").write_text(CPU_GRAPHS)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "cpu_graphs.py"}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NEURON_MOE_API_KEY"}
    return dict(
        env,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        HOST="127.0.0.1",  # the image's is 0.0.0.0; a test listens on loopback
        SM_MODEL_DIR=str(model_dir),
        SAGEMAKER_BIND_TO_PORT="0",  # SageMaker's port is 8080 unless it sets this; 0: a free one
        **more,
    )


def _same_answer(ours: httpx.Response, theirs: httpx.Response) -> dict:
    """The two answers agree but for what is unique to each response (id, created)."""
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    a, b = ours.json(), theirs.json()
    if ours.status_code == 200:
        assert a["id"].split("-")[0] == b["id"].split("-")[0] and a["id"] != b["id"]
        for body in (a, b):
            del body["id"], body["created"]
    assert a == b
    return a


def test_the_entrypoint_serves_sagemakers_contract(tmp_path, dry_run_artifact):  # noqa: F811
    model_dir = tmp_path / "opt" / "ml" / "model"
    model_dir.parent.mkdir(parents=True)
    dry_run_artifact.rename(model_dir)
    argv = [str(DOCKER / "entrypoint.sh"), "serve"]
    with server_process(argv, sagemaker_env(tmp_path, model_dir), "/ping") as (proc, _, url):
        assert httpx.get(f"{url}/ping").json()["model"] == "tiny-gemma4-moe"  # the port the manifest names

        # the bodies the /v1 routes take, answered alike; an endpoint serves one model, so a body
        # without `model` asks for it
        model = {"model": "tiny-gemma4-moe"}
        completion = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}
        for body, route, kind in (
            (completion, "completions", "text_completion"),
            (chat, "chat/completions", "chat.completion"),
        ):
            got = _same_answer(
                httpx.post(f"{url}/invocations", json={**body, **model}, timeout=60),
                httpx.post(f"{url}/v1/{route}", json={**body, **model}, timeout=60),
            )
            assert got["object"] == kind and got["usage"]["completion_tokens"] > 0
            assert got == _same_answer(
                httpx.post(f"{url}/invocations", json=body, timeout=60),
                httpx.post(f"{url}/v1/{route}", json={**body, **model}, timeout=60),
            )
        assert got["choices"][0]["message"]["role"] == "assistant" and got["choices"][0]["message"]["content"]

        # streamed (InvokeEndpointWithResponseStream): the same events
        streams = []
        for route, body in (("/invocations", completion), ("/v1/completions", {**completion, **model})):
            with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=60) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                streams.append(sse_events(r.iter_lines()))
        texts = [[e["choices"][0]["text"] for e in s if isinstance(e, dict) and e["choices"]] for s in streams]
        assert texts[0] == texts[1] and "".join(texts[0]) and streams[0][-1] == "[DONE]"

        # refused alike: a bad field of each kind, a body that is not JSON
        for bad, route in (
            ({"messages": "hi"}, "chat/completions"),
            ({"prompt": "x", "temperature": 3}, "completions"),
        ):
            error = _same_answer(
                httpx.post(f"{url}/invocations", json={**bad, **model}),
                httpx.post(f"{url}/v1/{route}", json={**bad, **model}),
            )
            assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] in bad
        for raw, message in ((b'{"prompt": ', "the request body is not valid JSON"), (b"[1]", "Input should be")):
            sent = {"content": raw, "headers": {"content-type": "application/json"}}
            error = _same_answer(httpx.post(f"{url}/invocations", **sent), httpx.post(f"{url}/v1/completions", **sent))
            assert error["error"]["message"].startswith(message), error

        proc.send_signal(signal.SIGTERM)  # SageMaker's stop: SIGKILL follows 30 s later
        assert proc.wait(sagemaker.DRAIN_TIMEOUT_S + 10) == 0


def test_the_serve_arguments_come_from_the_environment(tmp_path, dry_run_artifact):  # noqa: F811
    env = {"SM_MODEL_DIR": str(dry_run_artifact), "NEURON_MOE_SERVE_ARGS": "--max-queue 64 --served-model-name 'a b'"}
    argv = sagemaker.serve_argv(env, ["--log-level", "debug"])
    config = cli.serve_config(argv)
    serving = config.serving
    assert (config.model, config.backend.name, serving.artifacts) == (
        "tiny-gemma4-moe",
        "neuron",
        str(dry_run_artifact),
    )
    assert (serving.host, serving.tcp_port, serving.drain_timeout) == ("0.0.0.0", 8080, sagemaker.DRAIN_TIMEOUT_S)
    assert serving.max_queue == 64 and serving.served_model_name == ("a b",) and serving.log_level == "debug"
    assert cli.serve_config(sagemaker.serve_argv({**env, "SAGEMAKER_BIND_TO_PORT": "9001"})).serving.tcp_port == 9001
    with pytest.raises(UserError, match=r"^\$NEURON_MOE_SERVE_ARGS: No closing quotation"):
        sagemaker.serve_argv({**env, "NEURON_MOE_SERVE_ARGS": "'--max-queue"})
    assert sagemaker.DRAIN_TIMEOUT_S + 5 < 30  # uvicorn's grace after it (serve/server.py), before SIGKILL


@pytest.mark.parametrize(
    "env,message",
    [
        ({"SM_MODEL_DIR": "{missing}"}, "{missing}: no such directory: SageMaker copies the model data there"),
        ({"SM_MODEL_DIR": "{empty}"}, "{empty}: no manifest.json (expected a trace-and-compile output directory)"),
        ({"NEURON_MOE_API_KEY": "k"}, "NEURON_MOE_API_KEY is set, but SageMaker's invocations carry no bearer key"),
        # the key as a serve flag: every invocation would be 401 as well
        ({"NEURON_MOE_SERVE_ARGS": "--max-queue 4 --api-key k"}, "$NEURON_MOE_SERVE_ARGS sets --api-key, but Sage"),
        ({"NEURON_MOE_SERVE_ARGS": "--api-key=k"}, "$NEURON_MOE_SERVE_ARGS sets --api-key, but SageMaker's"),
        ({"argv": "--api-key k"}, "the container's command line sets --api-key, but SageMaker's invocations"),
    ],
)
def test_a_wrong_environment_is_one_line(tmp_path, monkeypatch, capsys, env, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    paths = {"missing": tmp_path / "missing", "empty": empty}
    for key in ("SM_MODEL_DIR", "NEURON_MOE_API_KEY", "NEURON_MOE_SERVE_ARGS", "SAGEMAKER_BIND_TO_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = dict(env)
    argv = env.pop("argv", "").split()
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(**paths))
    assert sagemaker.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.format(**paths)}") and err.count("\n") == 1, err


def test_the_endpoint_example_sends_requests_sagemaker_takes():
    """recipes/sagemaker/create_endpoint.py, not run against AWS: its model data is the publication's run
    folder, and its three requests pass botocore's own check of SageMaker's API (Stubber: no call leaves)."""
    import boto3
    from botocore.stub import Stubber

    from neuron_moe.neuron.plan import INSTANCES

    spec = importlib.util.spec_from_file_location(
        "create_endpoint", REPO / "recipes" / "sagemaker" / "create_endpoint.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    run = "runs/20261205T021500Z-0a1b2c3d"
    files = [
        {"path": p, "key": f"{run}/{p}"}
        for p in ("manifest.json", "model.pt", "weights/tp0_sharded_checkpoint.safetensors")
    ]
    model_data = example.run_prefix("s3://models/gemma4/bf16/", files)
    assert model_data == f"s3://models/gemma4/bf16/{run}/"
    with pytest.raises(SystemExit, match="not in one folder"):
        example.run_prefix("s3://models/x", [*files, {"path": "model.pt", "key": "runs/other/model.pt"}])

    args = example.parser().parse_args(
        [
            "--image",
            "123456789012.dkr.ecr.us-east-1.amazonaws.com/neuron-moe:neuron",
            "--artifacts",
            "s3://models/gemma4/bf16",
        ]
        + [
            "--role",
            "arn:aws:iam::123456789012:role/SageMakerExecution",
            "--name",
            "gemma4",
            "--serve-args",
            "--max-queue 64",
        ]
    )
    client = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="none", aws_secret_access_key="none")
    instance_types = set(client.meta.service_model.shape_for("ProductionVariantInstanceType").enum)
    assert {f"ml.{name}" for name in INSTANCES} <= instance_types and args.instance_type in instance_types
    arn = "arn:aws:sagemaker:us-east-1:123456789012:{}/gemma4"
    answers = {
        "create_model": {"ModelArn": arn.format("model")},
        "create_endpoint_config": {"EndpointConfigArn": arn.format("endpoint-config")},
        "create_endpoint": {"EndpointArn": arn.format("endpoint")},
    }
    calls = example.requests(args, model_data)
    assert [op for op, _ in calls] == list(answers)
    with Stubber(client) as stub:
        for operation, params in calls:
            stub.add_response(operation, answers[operation], params)
            getattr(client, operation)(**params)  # botocore validates the parameters against its model
        stub.assert_no_pending_responses()
    container = calls[0][1]["PrimaryContainer"]
    assert container["ModelDataSource"]["S3DataSource"]["S3Uri"] == model_data
    assert container["Environment"] == {"NEURON_MOE_SERVE_ARGS": "--max-queue 64"}

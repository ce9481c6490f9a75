"""`neuron-moe deploy k8s` (neuron_moe/deploy/k8s.py): the YAML it writes for each inf2 instance is valid
against Kubernetes' schemas (kubernetes-validate, offline), asks the Neuron device plugin for what the
plan says the TP degree needs, probes routes the server really answers (without the key, while it
loads), runs what the image's entrypoint runs, and lets the drain finish before the kill. Nothing here
runs on a cluster."""

import math
import socket
import threading
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml
from fastapi.routing import APIRoute
from prometheus_client.parser import text_string_to_metric_families

from neuron_moe import cli
from neuron_moe.errors import UserError
from neuron_moe.run_config import RunConfig
from neuron_moe.spec import compiled_backend
from neuron_moe.deploy import k8s
from neuron_moe.neuron import plan
from neuron_moe.neuron.plan import CORES_PER_CHIP, INSTANCES, GiB, port_plan
from neuron_moe.port import load_port
from neuron_moe.serve import server
from neuron_moe.serve.app import OPEN_PATHS, create_app
from neuron_moe.serve.metrics import Metrics
from neuron_moe.spec import TP_DEGREES

from serving import serving

KUBERNETES = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 bundles
ONE_CHIP = ("inf2.xlarge", "inf2.8xlarge")
URI = "s3://models/gemma4/bf16"


def deploy(tmp_path, *flags, out="out") -> tuple[Path, dict]:
    """Run `deploy k8s` with `flags`; (the directory, {file: parsed YAML})."""
    target = tmp_path / out
    assert cli.main(["deploy", "k8s", "--artifacts", URI, "--out", str(target), *flags]) == 0
    return target, {rel: yaml.safe_load((target / rel).read_text()) for rel in k8s.FILES}


def server_container(files: dict) -> dict:
    (container,) = files["deployment.yaml"]["spec"]["template"]["spec"]["containers"]
    return container


def neuron_limits(files: dict) -> dict:
    return {k: v for k, v in server_container(files)["resources"]["limits"].items() if k.startswith("aws.amazon.com/")}


@pytest.fixture
def offline(monkeypatch):
    """No connection can be opened: the schemas must come from the package itself."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# Every instance of the plan's table that the acceptance names (all are there); the full-size port with bf16
# or int8 experts fits the one-chip instances at no degree, so it is deployed there with the artifact's --tp;
# with int4 experts the plan picks its degree there.
CASES = [
    ("inf2.xlarge", "tiny-gemma4-moe", ()),
    ("inf2.8xlarge", "tiny-gemma4-moe", ("--resource", "neuron")),
    ("inf2.xlarge", "gemma4-26b-a4b", ("--tp", "2", "--quantization", "int8")),
    ("inf2.8xlarge", "gemma4-26b-a4b", ("--tp", "2", "--resource", "neuron")),
    ("inf2.xlarge", "gemma4-26b-a4b", ("--quantization", "int4")),
    ("inf2.24xlarge", "gemma4-26b-a4b", ()),
    ("inf2.24xlarge", "gemma4-26b-a4b", ("--quantization", "int8", "--resource", "neuron", "--replicas", "2")),
]


@pytest.mark.parametrize("instance,model,flags", CASES)
def test_manifests_are_valid_kubernetes_objects(tmp_path, offline, instance, model, flags):
    assert set(INSTANCES) >= {"inf2.xlarge", "inf2.8xlarge", "inf2.24xlarge"}
    out, files = deploy(tmp_path, "--instance", instance, "--model", model, *flags)
    for rel in k8s.OBJECTS:
        assert kubernetes_validate.validate(files[rel], KUBERNETES, strict=True) == "1.37"
    for rel in k8s.FILES:
        text = (out / rel).read_text()
        assert "# Not run on a cluster" in text.splitlines()[1], rel
    spec = files["deployment.yaml"]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": instance}
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert files["hpa.yaml"]["spec"]["scaleTargetRef"]["name"] == files["deployment.yaml"]["metadata"]["name"]


def test_the_validation_catches_a_wrong_object(tmp_path, offline):
    _, files = deploy(tmp_path, "--instance", "inf2.xlarge")
    deployment = files["deployment.yaml"]
    server_container(files)["startupProbe"]["httpGet"]["paht"] = "/health"  # a typo: an unknown field
    with pytest.raises(kubernetes_validate.ValidationError, match="'paht' was unexpected"):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def _plan(port, instance: str, tp: int, quantization: str) -> dict:
    """The plan of the artifact at TP `tp` (the port's [static] shapes)."""
    return port_plan(port, RunConfig(backend=compiled_backend("plan", tp, quantization)), instance)


def _smallest_fitting(model: str, instance: str, quantization: str) -> int:
    port = load_port(model)
    for tp in sorted(TP_DEGREES):
        if tp <= INSTANCES[instance].cores and _plan(port, instance, tp, quantization)["fits"]:
            return tp
    raise AssertionError(f"{model} fits {instance} at no degree")


@pytest.mark.parametrize(
    "model,instance,quantization",
    [
        ("tiny-gemma4-moe", "inf2.xlarge", "none"),
        ("tiny-gemma4-moe", "inf2.8xlarge", "none"),
        ("gemma4-26b-a4b", "inf2.24xlarge", "none"),
        ("gemma4-26b-a4b", "inf2.24xlarge", "int8"),
        ("gemma4-26b-a4b", "inf2.24xlarge", "int4"),
        ("gemma4-26b-a4b", "inf2.xlarge", "int4"),
        ("gemma4-26b-a4b", "inf2.8xlarge", "int4"),
    ],
)
def test_the_neuron_resources_are_what_the_plan_says_the_tp_degree_needs(tmp_path, model, instance, quantization):
    tp = _smallest_fitting(model, instance, quantization)
    args = ("--model", model, "--instance", instance, "--quantization", quantization)
    _, cores = deploy(tmp_path, *args, out="cores")
    _, chips = deploy(tmp_path, *args, "--resource", "neuron", out="chips")
    assert neuron_limits(cores) == {"aws.amazon.com/neuroncore": tp}
    assert neuron_limits(chips) == {"aws.amazon.com/neuron": math.ceil(tp / CORES_PER_CHIP)}
    assert tp <= INSTANCES[instance].cores


@pytest.mark.parametrize("instance", ONE_CHIP)
def test_int4_experts_put_the_26b_on_one_chip_at_tp_2(tmp_path, capsys, instance):
    """The plan fits the 26B's int4 experts on one chip at TP 2 (TP 1 does not fit a core), so deploy k8s
    picks TP 2 itself: both NeuronCores, or the one chip, per pod, and the command it writes names int4."""
    port = load_port("gemma4-26b-a4b")
    assert not _plan(port, instance, 1, "int4")["fits"]
    assert _plan(port, instance, 2, "int4")["fits"]
    flags = ("--model", "gemma4-26b-a4b", "--instance", instance, "--quantization", "int4", "--json", "-")
    _, cores = deploy(tmp_path, *flags, out="cores")
    report = yaml.safe_load(capsys.readouterr().out)
    assert report["tp"] == 2 and report["tp_from"] == "plan" and report["pods_per_node"] == 1
    assert "--quantization int4 --tp 2" in report["command"] and report["quantization"] == "int4"
    assert neuron_limits(cores) == {"aws.amazon.com/neuroncore": 2}
    assert "(trace-and-compile --tp 2 --quantization int4)" in k8s.render(report)
    _, chips = deploy(tmp_path, *flags, "--resource", "neuron", out="chips")
    assert neuron_limits(chips) == {"aws.amazon.com/neuron": 1}


@pytest.mark.parametrize("instance", ONE_CHIP)
def test_q4_0_on_every_linear_is_deployed_at_tp_2_and_named_whole(tmp_path, capsys, instance):
    """The one-chip recipe's build (q4_0 on every linear): deploy k8s picks TP 2 by its plan, and both the
    command it writes and the build it asks for name the quantized layers."""
    every = "experts,attention,mlp,lm_head"
    flags = ("--model", "gemma4-26b-a4b", "--instance", instance, "--quantization", "q4_0")
    deploy(tmp_path, *flags, "--quantized-layers", every, "--json", "-", out="q4_0")
    report = yaml.safe_load(capsys.readouterr().out)
    assert report["tp"] == 2 and report["tp_from"] == "plan" and report["quantized_layers"] == every.split(",")
    assert f"--quantization q4_0 --quantized-layers {every} --tp 2" in report["command"]
    assert f"(trace-and-compile --tp 2 --quantization q4_0 --quantized-layers {every})" in k8s.render(report)


def test_the_tp_is_planned_with_the_layers_the_artifact_quantizes(tmp_path):
    """The plan deploy k8s picks the degree by is the artifact's: its quantized layer groups
    (`Settings.quantized_layers`) in its format, every linear of the 26B here, against the experts alone."""
    port, every = load_port("gemma4-26b-a4b"), ("experts", "attention", "mlp", "lm_head")
    tp, report = k8s.resolve_tp(port, "inf2.xlarge", "int4", None, every)
    backend = compiled_backend("plan", 2, "int4", quantized_layers=every)
    assert tp == 2 and report == port_plan(port, RunConfig(backend=backend), "inf2.xlarge")
    settings = k8s.Settings("gemma4-26b-a4b", "inf2.xlarge", URI, quantization="int4", quantized_layers=every)
    written = k8s.write(settings, port, tmp_path / "out")
    assert written["plan"]["per_rank_total_bytes"] == report["per_rank_total_bytes"]
    assert report["per_rank_total_bytes"] < _plan(port, "inf2.xlarge", 2, "int4")["per_rank_total_bytes"]


def test_int4_at_a_degree_whose_ranks_split_its_groups_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """At TP 8 a rank of the channel layout holds 88 of down's input channels, not whole groups of 32:
    as the artifact's --tp that is one error line naming the tensor; among the degrees deploy k8s tries
    (here with NeuronCores made too small for any degree to fit) it is named with the others."""
    code = cli.main(
        ["deploy", "k8s", "--model", "gemma4-26b-a4b", "--instance", "inf2.24xlarge", "--tp", "8"]
        + ["--quantization", "int4", "--artifacts", URI, "--out", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: int4 experts: "), err
    assert "down_proj.weight on each of 8 ranks, channel layout" in err
    monkeypatch.setattr(plan, "CORE_HBM", 1 * GiB)
    code = cli.main(
        ["deploy", "k8s", "--model", "gemma4-26b-a4b", "--instance", "inf2.24xlarge", "--quantization", "int4"]
        + ["--artifacts", URI, "--out", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "fits inf2.24xlarge at no TP degree (TP 1: " in err and "; TP 4: " in err
    assert "; TP 8: int4 experts: " in err and "down_proj.weight on each of 8 ranks" in err
    assert not (tmp_path / "out").exists()


def test_the_artifacts_tp_is_taken_as_given_within_the_instance(tmp_path, capsys):
    _, files = deploy(tmp_path, "--model", "gemma4-26b-a4b", "--instance", "inf2.24xlarge", "--tp", "8")
    assert neuron_limits(files) == {"aws.amazon.com/neuroncore": 8}
    for instance in ONE_CHIP:
        code = cli.main(
            ["deploy", "k8s", "--model", "gemma4-26b-a4b", "--instance", instance, "--tp", "4"]
            + ["--artifacts", URI, "--out", str(tmp_path / "x")]
        )
        assert code == 2
        err = capsys.readouterr().err
        assert err == f"error: --tp 4: {instance} has 2 NeuronCores\n"
    assert not (tmp_path / "x").exists()


def test_a_model_that_fits_at_no_degree_is_refused_naming_each(tmp_path, capsys):
    code = cli.main(
        ["deploy", "k8s", "--model", "gemma4-26b-a4b", "--instance", "inf2.xlarge", "--artifacts", URI]
        + ["--out", str(tmp_path / "out")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: gemma4-26b-a4b with --quantization none fits inf2.xlarge at no TP degree (TP 1: ")
    assert "; TP 2: " in err and err.rstrip().endswith("deployed with --tp")
    assert not (tmp_path / "out").exists()


def test_the_containers_run_what_the_image_runs(tmp_path):
    """The pull lands where `serve --artifacts s3://...` would pull to; the server's arguments are
    serve's (parsed by its own parser, as the entrypoint passes them); the grace period outlasts the
    preStop pause, the drain and uvicorn's own grace after it."""
    _, files = deploy(tmp_path, "--model", "gemma4-26b-a4b", "--instance", "inf2.24xlarge", "--drain-timeout", "90")
    spec = files["deployment.yaml"]["spec"]["template"]["spec"]
    pull = next(c for c in spec["initContainers"] if c["name"] == "pull")
    assert pull["command"][:2] == ["neuron-moe", "pull"]
    pulled = cli.parser().parse_args(pull["command"][1:])
    assert pulled.uri == URI
    assert Path(pulled.dir) == server.s3_cache_dir(URI, Path(k8s.CACHE_MOUNT))

    container = server_container(files)
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    # docker/entrypoint.sh: neuron-moe serve --host "$HOST" --port "$PORT" "$@"
    config = cli.serve_config(["serve", "--host", env["HOST"], "--port", env["PORT"], *container["args"]])
    assert config.backend.name == "neuron" and config.model == "gemma4-26b-a4b"
    assert Path(config.serving.artifacts) == Path(pulled.dir)
    assert env["NEURON_MOE_API_KEY"] == {"secretKeyRef": {"name": "neuron-moe-api-key", "key": "api-key"}}
    (http,) = container["ports"]
    assert http == {"name": "http", "containerPort": config.serving.tcp_port, "protocol": "TCP"}

    mounts = {m["mountPath"]: m["name"] for c in [pull, container] for m in c["volumeMounts"]}
    assert mounts == {k8s.CACHE_MOUNT: "artifacts-cache"}
    (volume,) = spec["volumes"]
    assert volume["hostPath"]["path"] == k8s.CACHE_HOST_PATH  # shared by the pods on a node

    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert config.serving.drain_timeout == 90
    assert spec["terminationGracePeriodSeconds"] > pause + config.serving.drain_timeout + server.DRAIN_GRACE_S


@pytest.fixture
def loading_server():
    """The server's app with the key set, as the Deployment runs it, its model still loading."""
    release = threading.Event()

    def load():
        release.wait(30)
        raise RuntimeError("the test is over")

    app = create_app(load, model_name="m", api_key="k")
    with serving(app) as url:
        try:
            yield app, url
        finally:
            release.set()  # the load fails, and the server stops


def test_the_probes_ask_routes_the_server_answers_without_the_key(tmp_path, loading_server):
    """Startup and readiness fail while the model loads (503), liveness passes (a loading pod is not
    killed); none needs the key, which kubelet does not send."""
    app, url = loading_server
    _, files = deploy(tmp_path, "--instance", "inf2.xlarge")
    container = server_container(files)
    routes = {r.path for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods}
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert probe["port"] == "http" and probe["path"] in routes and probe["path"] in OPEN_PATHS
    assert httpx.get(f"{url}/v1/models").status_code == 401  # the key is on
    assert httpx.get(url + probes["startupProbe"]["path"]).status_code == 503
    assert httpx.get(url + probes["readinessProbe"]["path"]).status_code == 503
    assert httpx.get(url + probes["livenessProbe"]["path"]).status_code == 200
    window = container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"]
    assert window >= 30 * 60  # the Neuron image's own start period: loading takes many minutes


def test_the_autoscaler_reads_the_gauge_the_server_exports(tmp_path, loading_server):
    """HPA metric <- the adapter's rule <- the scrape job's series: the names, labels and port agree,
    and the series is one /metrics serves, without the key."""
    app, url = loading_server
    _, files = deploy(tmp_path, "--instance", "inf2.8xlarge", "--name", "chat", "--target-waiting", "3")
    (metric,) = files["hpa.yaml"]["spec"]["metrics"]
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "3"}
    (rule,) = files["prometheus/adapter-rules.yaml"]["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = rule["seriesQuery"].partition("{")[0]
    assert rule["name"]["matches"] == f"^{series}$"

    scraped = httpx.get(url + "/metrics")
    assert scraped.status_code == 200
    families = {f.name for f in text_string_to_metric_families(scraped.text)}
    assert series in families and series in {
        f.name for f in text_string_to_metric_families(Metrics("m").render().decode())
    }

    (job,) = files["prometheus/scrape-config.yaml"]["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and "/metrics" in OPEN_PATHS
    relabel = {tuple(r["source_labels"]): r for r in job["relabel_configs"]}
    pod_labels = files["deployment.yaml"]["spec"]["template"]["metadata"]["labels"]
    assert (
        relabel[("__meta_kubernetes_pod_label_app_kubernetes_io_instance",)]["regex"]
        == pod_labels["app.kubernetes.io/instance"]
        == "chat"
    )
    assert (
        relabel[("__meta_kubernetes_pod_container_port_name",)]["regex"] == server_container(files)["ports"][0]["name"]
    )
    targets = {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}
    assert targets == set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert files["service.yaml"]["spec"]["selector"] == pod_labels


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--name", "Chat_1"), "--name 'Chat_1': lower-case letters, digits and '-', starting with a letter"),
        (("--artifacts", "s3://bucket"), "--artifacts s3://bucket: no prefix"),
        (("--artifacts", "models/gemma"), "not an S3 URI: 'models/gemma'"),
        (("--replicas", "3", "--max-replicas", "2"), "--max-replicas 2 is below --replicas 3"),
        (("--service-account", "Pull_SA"), "--service-account 'Pull_SA': not a Kubernetes object name"),
        (("--image", "repo/img:1\nkind: Secret"), "--image 'repo/img:1\\nkind: Secret': empty, or a space or control"),
        (("--artifacts", "s3://../x"), "s3://../x: '..' is not an S3 bucket name"),
        (("--drain-timeout", "1e308"), "--drain-timeout 1e+308: must be in [0, 86400] seconds"),
    ],
)
def test_bad_settings_are_one_line_before_anything_is_written(tmp_path, capsys, flags, message):
    argv = ["deploy", "k8s", "--instance", "inf2.xlarge", "--artifacts", URI, "--out", str(tmp_path / "out"), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_it_rewrites_its_own_directory_and_no_other(tmp_path, capsys):
    out, _ = deploy(tmp_path, "--instance", "inf2.xlarge", "--replicas", "1")
    out, files = deploy(tmp_path, "--instance", "inf2.xlarge", "--replicas", "2")
    assert files["deployment.yaml"]["spec"]["replicas"] == 2
    (out / "notes.txt").write_text("mine")
    assert cli.main(["deploy", "k8s", "--instance", "inf2.xlarge", "--artifacts", URI, "--out", str(out)]) == 2
    assert "holds files deploy k8s did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_replicas_stay_within_int32(tmp_path):
    """Kubernetes' schema holds replicas, minReplicas and maxReplicas to int32: the default maximum
    (4 x --replicas) is capped there, not written past it."""
    _, files = deploy(tmp_path, "--instance", "inf2.xlarge", "--replicas", "2147483647")
    spec = files["hpa.yaml"]["spec"]
    assert spec["minReplicas"] == spec["maxReplicas"] == files["deployment.yaml"]["spec"]["replicas"] == 2**31 - 1


def test_the_cache_path_never_leaves_the_cache(tmp_path):
    """serve's --artifacts-cache folder of an s3:// URI, and deploy k8s's: a '..' bucket is refused, not
    joined into a path above the cache."""
    with pytest.raises(UserError, match=r"'\.\.' is not an S3 bucket name"):
        server.s3_cache_dir("s3://../x", tmp_path / "cache")
    assert server.s3_cache_dir("s3://b/p/q", tmp_path / "cache") == tmp_path / "cache" / "b" / "p" / "q"


def test_an_out_link_to_a_folder_is_written_through(tmp_path, capsys):
    """--out a symbolic link to a folder: the folder it points to is written (replaced whole), the link
    kept, as a file output is written through its link; --out a file is refused, the file kept."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    out, files = deploy(tmp_path, "--instance", "inf2.xlarge", out="link")
    assert out.is_symlink() and sorted(p.name for p in real.iterdir()) == sorted({f.split("/")[0] for f in k8s.FILES})
    (tmp_path / "file").write_text("mine")
    argv = ["deploy", "k8s", "--instance", "inf2.xlarge", "--artifacts", URI, "--out", str(tmp_path / "file")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"error: --out: {tmp_path / 'file'} exists and is not a directory\n"
    assert (tmp_path / "file").read_text() == "mine"

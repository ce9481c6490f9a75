#!/usr/bin/env python3
"""A SageMaker real-time endpoint on inf2 serving a published artifact, with boto3: create_model,
create_endpoint_config, create_endpoint, then (with --invoke) one chat request.

NOT RUN: no SageMaker endpoint was created with this script; its three requests are only checked
offline against botocore's SageMaker model (tests/test_sagemaker.py). See docs/deploy.md.

    python recipes/sagemaker/create_endpoint.py \\
        --image 123456789012.dkr.ecr.us-east-1.amazonaws.com/neuron-moe:neuron \\
        --artifacts s3://bucket/gemma4-26b-a4b-bf16-tp4 \\
        --role arn:aws:iam::123456789012:role/SageMakerExecution \\
        --instance-type ml.inf2.24xlarge --name gemma4 --invoke

The image is docker/Dockerfile.neuron pushed to ECR: SageMaker runs it as `docker run IMAGE serve`,
which its entrypoint serves as SageMaker's contract (neuron_moe/deploy/sagemaker.py). The model data
is the publication's current run (`neuron-moe publish` writes its files under
s3://bucket/prefix/runs/<run>/, named by s3://bucket/prefix/neuron-moe-manifest.json): SageMaker
copies that prefix, uncompressed, to /opt/ml/model, so the artifact lands there as trace-and-compile
wrote it. The execution role needs read access to it (and to the image). The endpoint serves the
artifact's TP degree on the instance type given; `neuron-moe plan` says which fit.
"""

from __future__ import annotations

import argparse
import json
import sys

STARTUP_TIMEOUT_S = 3600  # SageMaker's most: pulling tens of GB and loading onto the NeuronCores take minutes
PUBLICATION_MANIFEST = "neuron-moe-manifest.json"  # neuron_moe/publish/s3.py


def run_prefix(artifacts: str, files: list[dict]) -> str:
    """The S3 prefix that holds the publication's files as a directory: the folder every file's key
    (under the publication's prefix) puts its path in, ending in '/' as S3Prefix model data does."""
    bucket, _, prefix = artifacts[len("s3://") :].partition("/")
    folders = {f["key"][: len(f["key"]) - len(f["path"])] if f["key"].endswith(f["path"]) else None for f in files}
    if len(folders) != 1 or None in folders:
        raise SystemExit(f"error: {artifacts}: its files are not in one folder (not a neuron-moe publication?)")
    parts = [p for p in prefix.split("/") + folders.pop().split("/") if p]
    return f"s3://{bucket}/{'/'.join(parts)}/"


def requests(args, model_data: str) -> list[tuple[str, dict]]:
    """The three SageMaker calls, (operation, parameters) in order."""
    environment = {"NEURON_MOE_SERVE_ARGS": args.serve_args} if args.serve_args else {}
    variant = {
        "VariantName": "AllTraffic",
        "ModelName": args.name,
        "InstanceType": args.instance_type,
        "InitialInstanceCount": args.instances,
        "ContainerStartupHealthCheckTimeoutInSeconds": STARTUP_TIMEOUT_S,
        "ModelDataDownloadTimeoutInSeconds": STARTUP_TIMEOUT_S,
    }
    if args.volume_gb:
        variant["VolumeSizeInGB"] = args.volume_gb
    return [
        (
            "create_model",
            {
                "ModelName": args.name,
                "ExecutionRoleArn": args.role,
                "PrimaryContainer": {
                    "Image": args.image,
                    "ModelDataSource": {
                        "S3DataSource": {"S3Uri": model_data, "S3DataType": "S3Prefix", "CompressionType": "None"}
                    },
                    "Environment": environment,
                },
            },
        ),
        ("create_endpoint_config", {"EndpointConfigName": args.name, "ProductionVariants": [variant]}),
        ("create_endpoint", {"EndpointName": args.name, "EndpointConfigName": args.name}),
    ]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image", required=True, help="the Neuron serving image in ECR")
    p.add_argument("--artifacts", required=True, metavar="s3://BUCKET/PREFIX", help="a neuron-moe publication")
    p.add_argument("--role", required=True, metavar="ARN", help="the SageMaker execution role")
    p.add_argument("--instance-type", default="ml.inf2.24xlarge", help="(default: %(default)s)")
    p.add_argument("--instances", type=int, default=1, help="instances behind the endpoint (default 1)")
    p.add_argument("--name", required=True, help="the model, endpoint config and endpoint name")
    p.add_argument("--volume-gb", type=int, help="the ML storage volume, where the instance type takes one")
    p.add_argument("--serve-args", help="more serve flags, as $NEURON_MOE_SERVE_ARGS (e.g. '--max-queue 64')")
    p.add_argument("--region", help="AWS region (default: boto3's)")
    p.add_argument("--invoke", action="store_true", help="wait for the endpoint, then send one chat request")
    return p


def main(argv: list[str] | None = None) -> int:
    import boto3

    args = parser().parse_args(argv)
    session = boto3.Session(region_name=args.region)
    bucket, _, prefix = args.artifacts[len("s3://") :].partition("/")
    key = "/".join(p for p in (prefix.strip("/"), PUBLICATION_MANIFEST) if p)
    publication = json.loads(session.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
    model_data = run_prefix(args.artifacts, publication["files"])
    sagemaker = session.client("sagemaker")
    for operation, params in requests(args, model_data):
        answer = getattr(sagemaker, operation)(**params)
        print(operation, next(v for k, v in answer.items() if k.endswith("Arn")))
    if args.invoke:
        sagemaker.get_waiter("endpoint_in_service").wait(EndpointName=args.name)
        body = {"messages": [{"role": "user", "content": "The capital of France is?"}], "max_tokens": 32}
        answer = session.client("sagemaker-runtime").invoke_endpoint(
            EndpointName=args.name, ContentType="application/json", Body=json.dumps(body)
        )
        print(json.loads(answer["Body"].read())["choices"][0]["message"]["content"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`neuron-moe verify ARTIFACT|s3://BUCKET/PREFIX`: a trace-and-compile artifact checked whole, with
no SDK and no device: its manifest's contract (`neuron/artifact.py`: every field in range and
consistent with the files it lists), every file's size and sha256 against the manifest, no file it
does not list, the experts' weights in the manifest's quantization; the port it names (or --model's)
and the artifact built for it. A publication is read from S3 as it would be pulled (each object,
manifest.json too, against the publication's manifest), nothing written; a local manifest.json has no
digest to compare (the report says so). `serve --artifacts` makes the same checks before it needs the
Neuron SDK. A local dry-run artifact's graphs are also preflighted (`neuron/preflight.py`, for the
target it was built for): the report carries its summary, and a broken rule makes verify exit 1."""

from __future__ import annotations

import time
from pathlib import Path

from .neuron import artifact, preflight
from .neuron.artifact import MANIFEST, SHARD_PLAN, ArtifactError
from .port import PortError, load_port
from .publish import s3
from .report import loads_json


def verify(target: str, model: str | None = None, *, progress: bool = True, client=None) -> dict:
    """The report on `target` (a directory or an s3:// URI); raises ArtifactError (or PublishError)
    naming the first file or field that is wrong."""
    start = time.monotonic()
    port = load_port(model) if model is not None else None
    remote = target.startswith("s3://")
    where = target.rstrip("/") if remote else target
    if remote:
        manifest = _verify_publication(target, progress, client)
    else:
        if not Path(target).is_dir():
            raise ArtifactError(f"{target}: not a directory (an artifact is a trace-and-compile output directory)")
        manifest = artifact.verify(Path(target))
    if port is None:  # the port it names, a built-in one (a port of one's own: --model PATH)
        try:
            port = load_port(manifest["port"])
        except PortError:
            raise ArtifactError(
                f"{where}: built for port {manifest['port']!r}, which is not a built-in port: pass "
                "--model PATH (its port file)"
            ) from None
    artifact.check_port(manifest, port, where)
    graphs = not remote and preflight.graph_files(manifest)
    return {
        "artifact": target,
        "port": manifest["port"],
        "format": manifest["format"],
        "tp": manifest["tp"],
        "dtype": manifest["dtype"],
        "quantization": manifest["quantization"],
        "quantized_layers": manifest["quantized_layers"],
        "dry_run": manifest["dry_run"],
        "checked_port": port.name,
        "port_file": model is not None,
        "files": len(manifest["files"]),
        "total_bytes": sum(f["size"] for f in manifest["files"].values()),
        "manifest_digest": "publication" if remote else None,
        "weights": manifest["weights"],
        "weights_from": f"the rank shards and {SHARD_PLAN}" if manifest["weights"] and not remote else SHARD_PLAN,
        "preflight": preflight.summary(preflight.preflight(target)) if graphs else None,
        "seconds": round(time.monotonic() - start, 3),
    }


def _verify_publication(uri: str, progress: bool, client) -> dict:
    """The manifest of the artifact published at `uri`, every object read and checked against the
    publication's manifest (manifest.json's own digest included), then against the artifact's."""
    found, kept = s3.read_files(uri, (MANIFEST, SHARD_PLAN), progress=progress, client=client)
    where = uri.rstrip("/")
    if MANIFEST not in kept:
        raise ArtifactError(f"{where}: no {MANIFEST} (expected a publication of a trace-and-compile output)")
    try:
        raw = loads_json(kept[MANIFEST])
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where}/{MANIFEST}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"{where}/{MANIFEST}: expected a JSON object")
    manifest = artifact.check_manifest(raw, f"{where}/{MANIFEST}")
    artifact.check_files(where, manifest["files"], {k: v for k, v in found.items() if k != MANIFEST})
    try:
        plan = loads_json(kept[SHARD_PLAN])
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where}/{SHARD_PLAN}: not valid JSON: {e}") from None
    artifact.check_weight_dtypes(manifest, artifact.plan_dtypes(plan, f"{where}/{SHARD_PLAN}"), f"{where}/{SHARD_PLAN}")
    return manifest


def render_verify(report: dict) -> str:
    layers = ", ".join(report["quantized_layers"])
    weights = f"{report['quantization']} {layers}" if report["quantization"] != "none" else "no quantized layers"
    built = f"port {report['port']}, TP {report['tp']}, {report['dtype']}, {weights}" + (
        ", dry run" if report["dry_run"] else ""
    )
    digest = (
        f"{MANIFEST} itself: its size and sha256 match the publication's manifest"
        if report["manifest_digest"]
        else f"{MANIFEST} itself: no digest to compare here (a publication records one), its fields checked instead"
    )
    port = "--model's port file" if report["port_file"] else "the built-in port it names"
    shards = f"a weight shard per rank, {report['tp']} in all" if report["weights"] else "no weights, no shards"
    lines = [
        f"{report['artifact']}: {report['files']} file{'s' * (report['files'] != 1)} ({report['total_bytes']} "
        f"bytes) match the sizes and sha256 its {MANIFEST} lists, and no other file is there",
        f"{MANIFEST} (format {report['format']}: {built}): every field in range and consistent with the files "
        f"({shards}, the experts' dtypes in {report['weights_from']})",
        digest,
        f"built for port {report['checked_port']} ({port}: its name, tokenizer and expert layout)",
    ]
    if report["preflight"] is not None:
        lines.append(preflight.render_summary(report["preflight"]))
    return "\n".join(lines)

"""`neuron-moe verify ARTIFACT|s3://BUCKET/PREFIX`: a trace-and-compile artifact checked whole, with
no SDK and no device: its manifest's contract (`neuron/artifact.py`), every file's size and sha256
against the manifest, and no file it does not list; with a port, built for that port. A publication
is read from S3 as it would be pulled (each object against the publication's manifest too), nothing
written. `serve --artifacts` makes the same checks before it needs the Neuron SDK. A local dry-run
artifact's graphs are also preflighted (`neuron/preflight.py`, for the target it was built for): the
report carries its summary, and a broken rule makes verify exit 1."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .neuron import artifact, preflight
from .neuron.artifact import MANIFEST, ArtifactError
from .port import load_port
from .publish import s3


def verify(target: str, model: str | None = None, *, progress: bool = True, client=None) -> dict:
    """The report on `target` (a directory or an s3:// URI); raises ArtifactError (or PublishError)
    naming the first file or field that is wrong."""
    start = time.monotonic()
    port = load_port(model) if model is not None else None
    if target.startswith("s3://"):
        found, kept = s3.read_files(target, (MANIFEST,), progress=progress, client=client)
        where = target.rstrip("/")
        if MANIFEST not in kept:
            raise ArtifactError(f"{where}: no {MANIFEST} (expected a publication of a trace-and-compile output)")
        try:
            raw = json.loads(kept[MANIFEST], parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{where}/{MANIFEST}: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ArtifactError(f"{where}/{MANIFEST}: expected a JSON object")
        manifest = artifact.check_manifest(raw, f"{where}/{MANIFEST}")
        artifact.check_files(where, manifest["files"], {k: v for k, v in found.items() if k != MANIFEST})
        if port is not None:
            artifact.check_port(manifest, port, where)
    else:
        if not Path(target).is_dir():
            raise ArtifactError(f"{target}: not a directory (an artifact is a trace-and-compile output directory)")
        manifest = artifact.verify(Path(target), port)
    graphs = not target.startswith("s3://") and preflight.graph_files(manifest)
    return {
        "artifact": target,
        "port": manifest["port"],
        "format": manifest["format"],
        "tp": manifest["tp"],
        "dtype": manifest["dtype"],
        "dry_run": manifest["dry_run"],
        "checked_port": port.name if port is not None else None,
        "files": len(manifest["files"]),
        "total_bytes": sum(f["size"] for f in manifest["files"].values()),
        "preflight": preflight.summary(preflight.preflight(target)) if graphs else None,
        "seconds": round(time.monotonic() - start, 3),
    }


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def render_verify(report: dict) -> str:
    built = f"port {report['port']}, TP {report['tp']}, {report['dtype']}" + (", dry run" if report["dry_run"] else "")
    port = f"; built for --model {report['checked_port']}" if report["checked_port"] else ""
    whole = (
        f"{report['artifact']}: {report['files']} files ({report['total_bytes']} bytes) match its "
        f"{MANIFEST} (format {report['format']}: {built}){port}"
    )
    return whole if report["preflight"] is None else f"{whole}\n{preflight.render_summary(report['preflight'])}"

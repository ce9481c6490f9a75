"""One run's configuration: what a command runs (the port, its weights, the backend), at which
shapes, and how it serves, resolved once at the command line's edge (`cli.py`) and handed down
whole, as nano-vllm's `Config` and vLLM's `VllmConfig`. Frozen: nothing below the command line
changes it. A definition: no torch and no modules, so the parser's layer may build it.

The static graphs' shapes are one `Shapes`, laid over the port's [static] table by
`port.with_shapes`; the same fields are what an artifact's manifest records of them and what a
server reads back (`Shapes.from_manifest`). One length has one name: `max_cache_len`, the KV
cache's positions per row; vLLM's `--max-model-len`, a context in tokens, is max_cache_len + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from .spec import DEFAULT_PORT, DRAIN_TIMEOUT_S, Backend

if TYPE_CHECKING:  # speculative.py imports torch; the command line builds one only when the flag is given
    from .speculative import SpeculativeConfig

ARTIFACTS_CACHE = "~/.cache/neuron-moe/artifacts"  # where serve pulls an s3:// artifact to


@dataclass(frozen=True)
class Shapes:
    """The static graphs' shapes that the command line sets over the port's [static] table; a field
    None is the table's."""

    batch_size: int | None = None  # rows of every graph and of the KV cache (the requests generating at once)
    max_cache_len: int | None = None  # positions of the KV cache per row: a prompt and its completion
    buckets: tuple[int, ...] | None = None  # prefill lengths, strictly increasing
    prefill_rows: tuple[int, ...] | None = None  # prompts one prefill call takes, one graph per count
    prefill_chunk: int | None = None  # the longest piece of a prompt one prefill call takes (a bucket)
    # the KV lengths of the decode graphs, strictly increasing, the last max_cache_len: each step runs the
    # smallest above every row's position (NxDI's token-generation buckets)
    decode_lengths: tuple[int, ...] | None = None

    # the flag that sets each field, for the errors that name it
    FLAGS = {
        "batch_size": "--batch-size",
        "max_cache_len": "--max-cache-len",
        "buckets": "--buckets",
        "prefill_rows": "--prefill-rows",
        "prefill_chunk": "--prefill-chunk",
        "decode_lengths": "--decode-lengths",
    }

    def given(self) -> dict[str, object]:
        """The fields set, by their flag."""
        return {self.FLAGS[f.name]: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_manifest(cls, manifest: dict) -> Shapes:
        """The shapes an artifact was built at, as its manifest records them (`manifest_fields`); one
        without decode lengths has one decode graph, of the whole cache."""
        manifest = {"decode_lengths": [manifest["max_cache_len"]], **manifest}
        return cls(**{f.name: _tuple(manifest[f.name]) for f in fields(cls)})

    def manifest_fields(self) -> dict:
        """What an artifact's manifest records of these shapes (every field resolved)."""
        return {f.name: _list(getattr(self, f.name)) for f in fields(self)}


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


def _list(value):
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Serving:
    """serve's own settings: the socket, the client-facing limits, the scheduler, and where the
    artifacts come from."""

    host: str = "127.0.0.1"
    tcp_port: int = 8080  # 0: the OS picks a free one
    api_key: str | None = None
    served_model_name: tuple[str, ...] | None = None  # None: the port's name
    max_model_len: int | None = None  # the context in tokens a request may take (None: what the backend holds)
    max_running: int | None = None  # backends over transformers' model: its rows, requests generating at once
    max_queue: int = 32
    drain_timeout: float = DRAIN_TIMEOUT_S
    max_body_bytes: int | None = None  # None: serve/app.py's MAX_BODY_BYTES
    header_timeout: float | None = None  # None: serve/connection.py's HEADER_TIMEOUT_S
    body_timeout: float | None = None  # None: serve/app.py's BODY_TIMEOUT_S
    log_level: str = "info"
    artifacts: str | None = None  # a directory or s3://BUCKET/PREFIX
    artifacts_cache: str = ARTIFACTS_CACHE
    prefix_caching: bool | None = None  # None: the backend's default (static: on; neuron: as built)


@dataclass(frozen=True)
class RunConfig:
    """What a command runs, as the command line resolved it."""

    model: str = DEFAULT_PORT  # the port: a built-in name or a .toml path
    checkpoint: str | None = None  # the weights instead of the port's: a directory (a Hub id made one)
    revision: str | None = None  # with a Hub id: its branch, tag or commit
    backend: Backend | None = None  # what runs (experts, graphs, placement, reader, formats, dtype)
    shapes: Shapes = Shapes()
    compile: bool | None = None  # the static graphs compiled by torch.compile: None the default, False --no-compile
    compile_cache: str | None = None  # inductor's cache of what it compiled (spec.compile_cache)
    serving: Serving = field(default_factory=Serving)
    speculative: SpeculativeConfig | None = None  # --speculative-config, parsed and checked; None: off

"""Greedy generation over the static graphs: the host loop a compiled deployment runs.

The engine step (`rows.generate`): the prompts take the cache's rows a batch at a time, each
prefilled into its own row, padded to the smallest bucket that holds it (rows of one batch may use
different buckets), then every row decodes at once, each at its own position. The graphs share one
KV state (`cache.py`): nothing of the cache crosses the call boundary. Everything else the graphs
need to know arrives as tensors: ids, the pad mask, positions, the row ids. Bad input (too long a
prompt, too many tokens) is refused before any graph is exported or run.
"""

from __future__ import annotations

import torch
from torch.export.passes import move_to_device_pass
from tqdm import tqdm

from ..errors import UserError
from ..greedy import Generation
from ..model import build_model
from ..port import StaticSpec
from .cache import share_state
from .decoder import Decode, Prefill, new_cache
from .export import example_inputs, export
from .rows import bucket_for, generate, graph_runtime
from .runtime import static_runtime


class StaticInputError(UserError):
    pass


def choose_buckets(spec: StaticSpec, lengths: list[int], max_new_tokens: int) -> set[int]:
    """The bucket of each prompt (the smallest that holds it); every limit of the graphs checked."""
    longest = max(lengths)
    if longest > spec.buckets[-1]:
        raise StaticInputError(
            f"prompt of {longest} tokens exceeds the largest prefill bucket {spec.buckets[-1]} "
            f"(buckets: {list(spec.buckets)})"
        )
    check_cache(spec, longest, max_new_tokens)
    return {bucket_for(n, spec.buckets) for n in lengths}


def check_cache(spec: StaticSpec, longest: int, max_new_tokens: int) -> None:
    """The longest prompt and its new tokens fit the KV cache, or a StaticInputError."""
    if max_new_tokens < 1:
        raise StaticInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    # a prompt of n tokens holds positions 0..n-1; each generated token but the last is fed back at the next
    if longest + max_new_tokens - 1 > spec.max_cache_len:
        raise StaticInputError(
            f"{max_new_tokens} new tokens after a prompt of {longest} tokens need {longest + max_new_tokens - 1} "
            f"cache slots; max_cache_len is {spec.max_cache_len} "
            f"(at most {spec.max_cache_len - longest + 1} new tokens for this prompt)"
        )


def prompt_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row; each row must be left-padded (0...0 1...1), as `left_pad` makes it."""
    lengths = attention_mask.sum(-1)
    width = attention_mask.shape[1]
    for row, n in enumerate(lengths.tolist()):
        if n < 1 or not bool(attention_mask[row, width - n :].all()):
            raise StaticInputError(
                f"attention_mask row {row} is not a left-padded prompt (needs 0...0 1...1, at least one 1)"
            )
    return lengths.tolist()


class StaticGenerator:
    """Greedy generation through the exported programs (or, `exported=False`, the modules).

    `device`: where the graphs run and their state lives (the model must already be there when
    `exported=False`; exported programs are moved there). `logits=True` builds the validation
    graphs, which also return the logits; the serving graphs (False) return the token alone. Inputs
    are made on the host and sent; the token a graph picks (argmax in the graph) comes back to the
    host after each call (`rows.GraphRuntime`), which on a lazy device (torch-xla) runs each call
    as its own graph (bench/xla_check.py also syncs after each call, to meter it).
    """

    def __init__(
        self, model, spec: StaticSpec, exported: bool = True, device: torch.device | str = "cpu", logits: bool = False
    ):
        self.model, self.spec, self.exported, self.device = model, spec, exported, torch.device(device)
        self.logits = logits
        self.pad_id = model.config.pad_token_id or 0
        self.cache = new_cache(model, spec.max_cache_len, spec.batch_size)  # what the graphs are built over
        self.state: dict[str, torch.Tensor] | None = None  # what they run with: the one set, on `device`
        self.programs: dict[str, torch.export.ExportedProgram] = {}  # "prefill <bucket>", "decode"
        self._graphs: dict[str, torch.nn.Module] = {}  # the same, callable

    def check(self, attention_mask: torch.Tensor, max_new_tokens: int) -> set[int]:
        """The buckets these prompts will use, or a StaticInputError; does no work."""
        if max_new_tokens < 1:
            raise StaticInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        return choose_buckets(self.spec, prompt_lengths(attention_mask), max_new_tokens)

    def prepare(self, buckets) -> None:
        """Export (once) the prefill programs of `buckets` and the decode program."""
        todo = [(f"prefill {b}", b) for b in sorted(set(buckets))] + [("decode", None)]
        todo = [(name, bucket) for name, bucket in todo if name not in self._graphs]
        for name, bucket in tqdm(todo, desc="export", unit="graph", disable=not todo or not self.exported):
            graph = self._graph(name, bucket)
            self.state = share_state([graph], self.state)
            self._graphs[name] = graph

    def graph(self, bucket: int | None) -> Prefill | Decode:
        """The module of the prefill graph of `bucket`, or of the decode graph (bucket None)."""
        spec = self.spec
        if bucket is None:
            return Decode(self.model, self.cache, spec.decode_experts, self.logits)
        return Prefill(self.model, self.cache, spec.prefill_experts, self.logits)

    def _graph(self, name: str, bucket: int | None) -> torch.nn.Module:
        """The graph `name` as it will run: exported (and moved to the device), or the module."""
        graph = self.graph(bucket)
        if not self.exported:
            return graph
        program = export(graph, example_inputs(self.spec, bucket), name)
        self.programs[name] = program
        if self.device.type != "cpu":
            # the graph holds constants made on the CPU while tracing (aranges, lifted tensors)
            program = move_to_device_pass(program, self.device)
        return program.module()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> Generation:
        self.prepare(self.check(attention_mask, max_new_tokens))
        runtime = graph_runtime(self._graphs, self.spec.batch_size, self.pad_id, self.device)
        return Generation(*generate(runtime, input_ids, attention_mask, max_new_tokens))


def traced_backend(port, dtype=None, checkpoint=None, **formats):
    """`validate --backend traced`: the port's exported programs (the validation graphs, which
    return the logits too), every prompt checked before anything is exported. `formats`: build_model's
    quantization and quantized_layers (the weights' formats, unpacked inside each graph)."""
    spec = port.static_spec("validate --backend traced")
    model = build_model(port, spec.decode_experts, dtype, checkpoint, **formats)
    return StaticGenerator(model, spec, logits=True).generate


def static_backend(port, dtype=None, checkpoint=None, compile: bool = True, progress=None, speculative=None, **formats):
    """`validate --backend static`: the port's graphs as `serve --backend static` runs them (modules over
    one KV cache of the port's batch size, prompts longer than the prefill chunk prefilled a chunk at a
    time; compiled by torch.compile unless `compile=False`, `progress` told of each compile; speculating
    as `speculative` says, a `speculative.SpeculativeConfig`), built to return the logits too, the
    weights in `formats` as traced_backend's. Prompts that do not fit the cache are refused before any
    graph runs."""
    spec = port.static_spec("validate --backend static")
    model = build_model(port, spec.decode_experts, dtype, checkpoint, **formats)
    runtime = static_runtime(model, spec, logits=True, compile=compile, progress=progress, speculative=speculative)

    @torch.no_grad()
    def generate_static(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> Generation:
        check_cache(spec, max(prompt_lengths(attention_mask)), max_new_tokens)
        return Generation(*generate(runtime, input_ids, attention_mask, max_new_tokens))

    return generate_static

"""Greedy generation over the static graphs: the host loop a compiled deployment runs.

The host picks the bucket, left-pads the batch to it (and to the compiled batch size), runs
the bucket's prefill program once and the decode program once per further token. Everything
the graphs need to know about the data arrives as tensors: positions, the cache slot, the
attention mask. Bad input (too long a prompt, too many tokens, too big a batch) is refused
before any graph is exported or run.
"""

from __future__ import annotations

import torch
from torch.export.passes import move_to_device_pass
from tqdm import tqdm

from ..errors import UserError
from ..generate import Generation
from ..port import StaticSpec
from .decoder import Decode, Prefill
from .export import export_decode, export_prefill
from .loop import run_graphs


class StaticInputError(UserError):
    pass


def choose_bucket(spec: StaticSpec, batch: int, longest: int, max_new_tokens: int) -> int:
    """The smallest bucket that holds the longest prompt; every limit of the graphs checked."""
    if batch > spec.batch_size:
        raise StaticInputError(f"batch of {batch} prompts exceeds the compiled batch size {spec.batch_size}")
    if longest > spec.buckets[-1]:
        raise StaticInputError(f"prompt of {longest} tokens exceeds the largest prefill bucket {spec.buckets[-1]} "
                               f"(buckets: {list(spec.buckets)})")
    bucket = next(b for b in spec.buckets if b >= longest)
    # the prompt fills slots [0, bucket); each generated token but the last is fed back into a slot
    if bucket + max_new_tokens - 1 > spec.max_cache_len:
        raise StaticInputError(
            f"{max_new_tokens} new tokens after a prompt padded to bucket {bucket} need "
            f"{bucket + max_new_tokens - 1} cache slots; max_cache_len is {spec.max_cache_len} "
            f"(at most {spec.max_cache_len - bucket + 1} new tokens in this bucket)")
    return bucket


def prompt_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row; each row must be left-padded (0...0 1...1), as `left_pad` makes it."""
    lengths = attention_mask.sum(-1)
    width = attention_mask.shape[1]
    for row, n in enumerate(lengths.tolist()):
        if n < 1 or not bool(attention_mask[row, width - n:].all()):
            raise StaticInputError(f"attention_mask row {row} is not a left-padded prompt (needs 0...0 1...1, "
                                   f"at least one 1)")
    return lengths.tolist()


class StaticGenerator:
    """Greedy generation through the exported programs (or, `exported=False`, the modules).

    `device`: where the graphs run and their inputs are made (the model must already be there
    when `exported=False`; exported programs are moved there). Tokens and logits stay on it
    until the end: the token a graph picks (argmax in the graph) is fed straight back. On a lazy
    device (torch-xla) wrap each graph so that it syncs after its call (bench/xla_check.py),
    or the whole loop becomes one graph.
    """

    def __init__(self, model, spec: StaticSpec, exported: bool = True, device: torch.device | str = "cpu"):
        self.model, self.spec, self.exported, self.device = model, spec, exported, torch.device(device)
        self.pad_id = model.config.pad_token_id or 0
        self.programs: dict[str, torch.export.ExportedProgram] = {}  # "prefill <bucket>", "decode"
        self._graphs: dict[str, torch.nn.Module] = {}  # the same, callable

    def check(self, attention_mask: torch.Tensor, max_new_tokens: int) -> int:
        """The bucket this batch will use, or a StaticInputError; does no work."""
        if max_new_tokens < 1:
            raise StaticInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        lengths = prompt_lengths(attention_mask)
        return choose_bucket(self.spec, len(lengths), max(lengths), max_new_tokens)

    def prepare(self, buckets) -> None:
        """Export (once) the prefill programs of `buckets` and the decode program."""
        todo = [(f"prefill {b}", b) for b in sorted(set(buckets))] + [("decode", None)]
        todo = [(name, bucket) for name, bucket in todo if name not in self._graphs]
        for name, bucket in tqdm(todo, desc="export", unit="graph", disable=not todo or not self.exported):
            self._graphs[name] = self._graph(name, bucket)

    def _graph(self, name: str, bucket: int | None) -> torch.nn.Module:
        """The prefill graph of `bucket`, or the decode graph (bucket None): exported, or the module."""
        spec = self.spec
        if not self.exported:
            return (Decode(self.model, spec.max_cache_len, spec.decode_experts) if bucket is None
                    else Prefill(self.model, spec.max_cache_len, spec.prefill_experts))
        program = export_decode(self.model, spec) if bucket is None else export_prefill(self.model, spec, bucket)
        self.programs[name] = program
        if self.device.type != "cpu":
            # the graph holds constants made on the CPU while tracing (aranges, lifted tensors)
            program = move_to_device_pass(program, self.device)
        return program.module()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> Generation:
        bucket = self.check(attention_mask, max_new_tokens)
        self.prepare([bucket])
        spec = self.spec
        return Generation(*run_graphs(self._graphs, spec.batch_size, spec.max_cache_len, self.pad_id, bucket,
                                      input_ids, attention_mask, max_new_tokens, self.device))


def traced_backend(port, dtype=None, checkpoint=None):
    """`validate --backend traced`: the port's exported programs, prompts run in batches of the
    compiled batch size (every batch is checked before anything is exported)."""
    from ..model import build_model

    if port.static is None:
        raise UserError(f"port {port.name!r} has no [static] table (buckets, max_cache_len, batch_size, "
                        f"prefill_experts, decode_experts): it has no traced graphs")
    generator = StaticGenerator(build_model(port, port.static.decode_experts, dtype, checkpoint), port.static)
    return lambda ids, mask, n: generate_batches(generator, ids, mask, n)


def generate_batches(generator: StaticGenerator, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     max_new_tokens: int) -> Generation:
    """Any number of prompts, in batches of the compiled batch size (every batch is checked, and
    the buckets they need exported, before any batch runs)."""
    size = generator.spec.batch_size
    batches = [(input_ids[i:i + size], attention_mask[i:i + size]) for i in range(0, len(input_ids), size)]
    generator.prepare([generator.check(mask, max_new_tokens) for _, mask in batches])
    outs = [generator.generate(ids, mask, max_new_tokens) for ids, mask in batches]
    return Generation(torch.cat([o.tokens for o in outs]), torch.cat([o.logits for o in outs]))

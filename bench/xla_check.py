"""XLA lowering check on CPU: the static prefill/decode graphs through torch-xla 2.9.

torch-neuronx (Neuron SDK 2.31, the last with inf2) lowers each graph to HLO through torch-xla
and hands the HLO to neuronx-cc. This runs the part of that path that is not Neuron-specific,
on XLA:CPU (`PJRT_DEVICE=CPU`): the tiny port's serving graphs — the prefill (one graph per
bucket, one prompt into its own cache row) and decode graphs, with the KV cache as their shared
device state and the greedy token as their only output — move to the XLA device and generate
greedily through the engine step (`StaticGenerator` over `static/rows.py`: argmax in the graph,
the token read back to the host and sent as the next step's input; never HF generate).

Per graph, from torch-xla's own metrics: compilations on the first call and on every later call
(a later one means a dynamic shape slipped in), every `aten::` counter (an op that fell back
to eager CPU, which the Neuron compiler would never see), and the bytes that crossed between
host and device (`OutboundData`, `InboundData`) per call, beside the bytes of the call's own
inputs and outputs (what NxD's runtime moves to and from the host for every input and every
output that is not an aliased state). Tokens are compared with the CPU reference (HF eager, fp32:
SEQ_MATCH); each weight format's run (int8, int4, q4_0 on every linear: `formats/`) also with the same
quantized model on the CPU. Exit 0 only when every graph settles to one compilation, nothing falls
back, the fp32 runs match the reference and each format's run its CPU model.

The serving run drives the exported programs as the batching engine calls them, through its
runtime (`static/rows.GraphRuntime`): a prefill graph of several prompts, a prompt prefilled in chunks
between decode steps, and rows sampled in the graphs (temperature, top-k, top-p, each row's own
uniform draw) beside greedy rows; its tokens are compared with the same programs on the CPU given
the same inputs, its greedy row with HF eager, and the bytes a decode call returns are counted
(the B token ids; no logits).

The prefix-caching run drives the same engine step with prefix caching on (`static/prefix.py`):
the cache in the whole-row layout (sliding layers keep every position), a prompt longer than the
sliding window prefilled in chunks, then, while it generates, a second prompt sharing its first
blocks: those copied into the second row by the copy graph and only the rest prefilled; both rows'
tokens compared with the same programs on the CPU and with HF eager.

The run of the new graphs (`--only new` runs it alone) drives, over one cache with the slack of k = 4
drafts, the graphs speculative decoding and the fused step add, as the engine's runtime calls them:
a prompt prefilled whole; another in chunks by the step graph (`Step`: a chunk and the decode of every
row in one call); decode steps routed by KV length (the graph of the shortest, `Decode(span=L)`, until
a row passes it, then the whole cache's); then verify calls (`Verify`, q = 5: a greedy row and a
sampled row, a draw per column), the first of prompt lookup's drafts, the later ones of the built-in
assistant's (`draft.Draft`, from the verify graph's hidden state). Every token, draft and acceptance
is compared with the same programs on the CPU, the greedy row's tokens with HF eager.

Where OUT-baseline.json exists (the OUT.json of this check run in another checkout, e.g. main's
before a change), the report shows the bytes per decode step before and after side by side.

The exported runs run the `torch.export` programs themselves; the JSON records their ops, and the
report whether each is on the allow-list `neuron_moe/static/xla_lowered_ops.txt` that the normal
test suite (no torch-xla) holds the graphs to. `python -m tools.xla_ops` (`make xla-ops`) writes
that list from this check's JSON once every run lowered cleanly.

    make xla-check        # = PJRT_DEVICE=CPU .venv-xla/bin/python -m bench.xla_check --hlo build/xla-check-hlo
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.export.passes import move_to_device_pass

from bench.harness import code, write_results
from neuron_moe import report
from neuron_moe.errors import UserError
from neuron_moe.eval.seq_match import DEFAULT_PROMPTS
from neuron_moe.formats import FORMATS
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.hub import check_assistant
from neuron_moe.model import build_model
from neuron_moe.port import load_port
from neuron_moe.neuron.compile import verify_inputs
from neuron_moe.spec import LAYER_GROUPS, NO_QUANTIZATION
from neuron_moe.speculative import SpeculativeConfig, ngram_propose
from neuron_moe.static import XLA_LOWERED_OPS_FILE, data_dependent_ops, graph_ops, xla_lowered_ops
from neuron_moe.static.cache import share_state
from neuron_moe.static.decoder import (
    Copy,
    Decode,
    Prefill,
    ProcessingDecode,
    ProcessingPrefill,
    Step,
    Verify,
    new_cache,
    new_counts,
)
from neuron_moe.static.draft import Draft, load_assistant
from neuron_moe.static.export import GraphError, copy_inputs, example_inputs, export, functional, graph_inputs
from neuron_moe.static.generator import StaticGenerator
from neuron_moe.static.prefix import BLOCK, PrefixIndex
from neuron_moe.static.rows import Chunk, GraphRuntime, Rows
from neuron_moe.static.sampling import CANDIDATES, GREEDY, Processing, neutral_inputs
from neuron_moe.tokenizer import ByteTokenizer

# The default prompts need the 56-token bucket; the short pair runs the 8-token one.
PROMPTS = (*DEFAULT_PROMPTS, "Hi", "2+2=")


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    prefill: str  # experts implementation of the prefill graphs
    decode: str  # ... and of the decode graph
    exported: bool  # the torch.export programs (True) or the modules (what lazy tracing sees)
    quantization: str = NO_QUANTIZATION  # the weight format of every linear (`formats/`): none, the model's own


RUNS = (
    Run("exported, dense_masked prefill, selective decode (the port's [static])", "dense_masked", "selective", True),
    Run("exported, dense_masked prefill and decode", "dense_masked", "dense_masked", True),
    Run("modules, dense_masked prefill, selective decode", "dense_masked", "selective", False),
    *(
        Run(
            f"exported, {q} on every linear, dense_masked prefill, selective decode",
            "dense_masked",
            "selective",
            True,
            q,
        )
        for q in FORMATS
        if q != NO_QUANTIZATION
    ),
)


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in a call's arguments or outputs (tuples and lists walked)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, (tuple, list)):
        return sum(tensor_bytes(t) for t in tree)
    return 0


class Metered:
    """One graph on the XLA device: each call runs it, syncs (one HLO graph per call) and records
    the compilations and `aten::` fallbacks that the call caused, the host<->device bytes moved since
    the previous graph call ended (the host loop makes this call's inputs and reads the previous
    one's outputs in between), the bytes of its own inputs and outputs, and its wall time."""

    def __init__(self, xla, name: str, graph, hlo_dir: Path | None):
        self.xla, self.name, self.graph, self.hlo_dir = xla, name, graph, hlo_dir
        self.calls: list[dict] = []
        self.cache_hits = 0  # graphs found already compiled (same HLO, e.g. by an earlier run)
        self.hlo_ops: dict[str, int] = {}  # HLO instructions worth a look before neuronx-cc sees them

    def __call__(self, *args):
        xla = self.xla
        compiles, fallbacks, hits = xla.compiles(), xla.fallbacks(), xla.cache_hits()
        start = time.perf_counter()
        outs = self.graph(*args)
        if self.hlo_dir is not None and not self.calls:
            self.hlo_dir.mkdir(parents=True, exist_ok=True)
            text = xla.hlo(list(outs))
            (self.hlo_dir / f"{self.name.replace(' ', '-')}.hlo.txt").write_text(text)
            self.hlo_ops = {op: text.count(f" {op}(") for op in ("sort", "custom-call", "while", "conditional")}
        xla.sync()
        after, (to_device, to_host) = xla.fallbacks(), xla.moved()
        self.calls.append(
            {
                "compiles": xla.compiles() - compiles,
                "fallbacks": {k: v - fallbacks.get(k, 0) for k, v in after.items() if v != fallbacks.get(k, 0)},
                "to_device": to_device,
                "to_host": to_host,
                "inputs": tensor_bytes(args),
                "outputs": tensor_bytes(outs),
                "s": time.perf_counter() - start,
            }
        )
        if len(self.calls) == 1:
            self.cache_hits = xla.cache_hits() - hits
        return outs

    def summary(self) -> dict:
        first, later = self.calls[0], self.calls[1:]
        fallbacks: dict[str, int] = {}
        for call in self.calls:
            for k, v in call["fallbacks"].items():
                fallbacks[k] = fallbacks.get(k, 0) + v
        # the steady state: the first decode call also carries the batch's first tokens across
        per_call = {
            k: statistics.median(c[k] for c in self.calls) for k in ("to_device", "to_host", "inputs", "outputs")
        }
        return {
            "graph": self.name,
            "calls": len(self.calls),
            "compiles_first_call": first["compiles"],
            "cache_hit_first_call": self.cache_hits,
            "compiles_later_calls": sum(c["compiles"] for c in later),
            "aten_fallbacks": fallbacks,
            "hlo_ops": self.hlo_ops,
            **{f"{k}_bytes_per_call": v for k, v in per_call.items()},
            "first_call_s": first["s"],
            "later_call_ms": 1e3 * statistics.median(c["s"] for c in later) if later else None,
        }


class Xla:
    """The few torch-xla calls the check makes (imported lazily: the package never needs them)."""

    def __init__(self):
        try:
            import torch_xla
            import torch_xla.debug.metrics as met
        except ImportError as e:
            sys.exit(
                f"error: torch-xla is not installed in this Python ({sys.executable}): {e}. "
                f"Run `make xla-check`, which creates .venv-xla with torch==2.9.0 and torch-xla==2.9.0."
            )
        if os.environ.get("PJRT_DEVICE") != "CPU":
            sys.exit("error: set PJRT_DEVICE=CPU (this check runs XLA on the CPU)")
        self.torch_xla, self.met = torch_xla, met
        self.device = torch_xla.device()
        self.version = torch_xla.__version__
        self.mark = self.transfers()

    def compiles(self) -> int:
        data = self.met.metric_data("CompileTime")
        return data[0] if data else 0

    def cache_hits(self) -> int:
        return self.met.counter_value("CachedCompile") or 0

    def transfers(self) -> tuple[int, int]:
        """Bytes moved so far (host -> device, device -> host): PJRT's OutboundData and InboundData."""
        return tuple(int((self.met.metric_data(name) or (0, 0))[1]) for name in ("OutboundData", "InboundData"))

    def moved(self) -> tuple[int, int]:
        """Bytes moved since the last call of this (or `start_moving`)."""
        now = self.transfers()
        delta, self.mark = (now[0] - self.mark[0], now[1] - self.mark[1]), now
        return delta

    def fallbacks(self) -> dict[str, int]:
        return {n: self.met.counter_value(n) for n in self.met.counter_names() if n.startswith("aten::")}

    def sync(self):
        self.torch_xla.sync(wait=True)

    def hlo(self, tensors) -> str:
        return self.torch_xla._XLAC._get_xla_tensors_hlo(tensors)


def seq_match(reference, got) -> dict:
    """SEQ_MATCH on the tokens (the serving graphs return no logits)."""
    firsts = []
    for ref, tokens in zip(reference.tokens, got.tokens):
        diverged = (ref != tokens).nonzero()
        firsts.append(int(diverged[0]) if len(diverged) else None)
    return {
        "all_match": all(f is None for f in firsts),
        "matched": sum(f is None for f in firsts),
        "first_divergence": firsts,
    }


def check_run(xla: Xla, port, run: Run, ids, mask, new_tokens: int, references: dict, hlo_dir) -> tuple[dict, dict]:
    """One run on XLA: (its report row, {graph name: op set} of its exported programs)."""
    spec = dataclasses.replace(port.static, prefill_experts=run.prefill, decode_experts=run.decode)
    # a format's tensors are made once, on the CPU, as trace-and-compile writes them: the graphs only unpack
    model = build_model(port, run.decode, quantization=run.quantization, quantized_layers=LAYER_GROUPS)
    start = time.perf_counter()
    if not run.exported:
        model = model.to(xla.device)
    # the serving graphs: the token alone
    generator = StaticGenerator(model, spec, exported=run.exported, device=xla.device, logits=False)
    generator.prepare(generator.check(mask, new_tokens))
    export_s = time.perf_counter() - start
    tag = f"{run.prefill}-{run.decode}-{'exported' if run.exported else 'modules'}" + (
        "" if run.quantization == NO_QUANTIZATION else f"-{run.quantization}"
    )
    # the generator's graphs, each replaced by its metered self (the loop calls them by name)
    graphs = {name: Metered(xla, f"{tag} {name}", graph, hlo_dir) for name, graph in generator._graphs.items()}
    generator._graphs = dict(graphs)
    compiles_before, moved_before = xla.compiles(), xla.transfers()
    xla.moved()
    start = time.perf_counter()
    got = generator.generate(ids, mask, new_tokens)
    generate_s = time.perf_counter() - start
    moved = [now - before for now, before in zip(xla.transfers(), moved_before)]
    summaries = [g.summary() for g in graphs.values()]
    graph_compiles = sum(g["compiles_first_call"] + g["compiles_later_calls"] for g in summaries)
    decode_steps = len(graphs["decode"].calls)
    row = {
        "run": run.name,
        "exported": run.exported,
        "prefill_experts": run.prefill,
        "decode_experts": run.decode,
        "graphs": summaries,
        # compilations outside the graphs: collecting the tokens (and logits) for the host
        "other_compiles": xla.compiles() - compiles_before - graph_compiles,
        # everything the generation moved, prefills and the tokens (and logits) read at the end included
        "generation_to_device_bytes_per_decode_call": moved[0] / decode_steps,
        "generation_to_host_bytes_per_decode_call": moved[1] / decode_steps,
        "export_s": export_s if run.exported else None,
        "generate_s": generate_s,
        "vs_cpu_fp32": seq_match(references["fp32"], got),
    }
    if run.quantization != NO_QUANTIZATION:
        row[f"vs_cpu_{run.quantization}"] = seq_match(references[run.quantization], got)
    ops = {name: graph_ops(program) for name, program in generator.programs.items()}
    return row, ops


SERVING = "exported, the serving runtime: batched and chunked prefill, sampled and greedy rows"
SERVING_TOKENS = 12  # tokens of the serving run's chunked greedy row


def placed(xla: Xla | None, programs: dict, hlo_dir, tag: str):
    """The programs' modules on XLA (metered, `tag` naming them) or on the CPU (xla None), their state
    one zeroed set, and `on`: a graph as a callable that sends its arguments to the device."""
    device = "cpu" if xla is None else xla.device
    graphs = {name: (p if xla is None else move_to_device_pass(p, device)).module() for name, p in programs.items()}
    share_state(graphs.values())
    if xla is not None:
        graphs = {name: Metered(xla, f"{tag} {name}", g, hlo_dir) for name, g in graphs.items()}

    def on(graph):
        return lambda *args: graph(*(a.to(device) for a in args))

    return graphs, on


def serving_runtime(
    xla: Xla | None, programs: dict, spec, bucket: int, hlo_dir, copy: bool = False, tag: str = "serving"
):
    """The programs behind the batching engine's runtime, on XLA (metered) or on the CPU (xla None),
    their KV state one zeroed set; prefill calls routed by their row count, as NxD routes by shape;
    `copy`: the copy graph too (prefix caching)."""
    graphs, on = placed(xla, programs, hlo_dir, tag)

    def prefill(*args):
        return on(graphs[f"prefill {args[0].shape[0]}x{bucket}"])(*args)

    def prefill_processing(*args):
        return on(graphs[f"prefill processing {args[0].shape[0]}x{bucket}"])(*args)

    runtime = GraphRuntime(
        prefill,
        on(graphs["decode"]),
        dataclasses.replace(spec.shapes(), buckets=(bucket,), prefill_chunk=bucket),
        prefill_processing=prefill_processing if "decode processing" in graphs else None,
        decode_processing=on(graphs["decode processing"]) if "decode processing" in graphs else None,
        vocab=VOCAB,
        logits=False,
        candidates=CANDIDATES,
        copy=on(graphs["copy"]) if copy else None,
    )
    return runtime, graphs


def drive(runtime, long: list[int], short: list[int], draws: list[tuple], bucket: int, pad: int) -> dict:
    """Row 0: `long` prefilled a chunk of `bucket` at a time, then greedy; row 1: `short`, sampled
    (its i-th token from draws[i]). The first call prefills both rows at once; row 1 decodes
    between row 0's chunks, and row 0 sits in the decode batch at its next chunk's position."""
    draws = iter(draws)
    tokens, _ = runtime.prefill([Chunk(long[:bucket], 0, 0, GREEDY), Chunk(short, 0, 1, next(draws))])
    out, done = {0: [], 1: [int(tokens[1])]}, bucket
    while len(out[0]) < SERVING_TOKENS:
        if done < len(long):
            piece = long[done : done + bucket]
            tokens, _ = runtime.prefill([Chunk(piece, done, 0, GREEDY)])
            done += len(piece)
            if done == len(long):
                out[0].append(int(tokens[0]))
        generating = bool(out[0])
        ids = torch.tensor([[out[0][-1] if generating else pad], [out[1][-1]]])
        positions = torch.tensor(
            [[len(long) + len(out[0]) - 1 if generating else done], [len(short) + len(out[1]) - 1]]
        )
        tokens, _ = runtime.decode(ids, positions, torch.tensor([GREEDY, next(draws)]))
        if generating:
            out[0].append(int(tokens[0]))
        out[1].append(int(tokens[1]))
    return out


VOCAB = 2048  # the tiny port's
PROCESSING = Processing(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.02)
PROCESSING_TOKENS = 8


def drive_processing(runtime, prompt: list[int], other: list[int], draws: list[tuple]) -> dict:
    """The logits-processing variants as the engine step calls them: row 0 asks (penalties, min_p, a
    logit bias, two banned ids, a bitmask allowing the even tokens), row 1 asks nothing; both are
    prefilled by the variant prefill but for their prompts' last tokens, in one call of both rows
    (row 0's first chunk) and one of row 0 (its second, after the first), with their prompts'
    logprobs; then each is fed its last prompt token, row 0 sampled, row 1 greedy with neutral
    inputs, in the same variant decode calls: (tokens per row, row 0's logprobs, the prompts'
    logprobs)."""
    half = (len(prompt) - 1) // 2
    first = runtime.prefill_processing(
        [Chunk(prompt[:half], 0, 0, GREEDY, prompt[1 : half + 1]), Chunk(other[:-1], 0, 1, GREEDY, other[1:])]
    )
    (second,) = runtime.prefill_processing([Chunk(prompt[half:-1], half, 0, GREEDY, prompt[half + 1 :])])
    process, bias_ids, bias, mask = neutral_inputs(2, VOCAB)
    process[0] = torch.tensor([*PROCESSING.values(), 0.0, 1.0, 0.0])  # the fed token: the prompt's last
    bias_ids[0, :3], bias[0, :3] = torch.tensor([5, 7, 9]), torch.tensor([2.0, -math.inf, -math.inf])
    mask[0] = 0x55555555  # bit t % 32 for even t: the even tokens
    ids = torch.tensor([[prompt[-1]], [other[-1]]])
    positions = torch.tensor([[len(prompt) - 1], [len(other) - 1]])
    out, logprobs = {0: [], 1: []}, []
    for i in range(PROCESSING_TOKENS):
        sampling = torch.tensor([draws[i], GREEDY])
        tokens, scores, _ = runtime.decode_processing(ids, positions, sampling, process, bias_ids, bias, mask)
        process[0, 4:] = torch.tensor([0.0, 0.0, 1.0])  # from now on a generated token is fed
        for row in (0, 1):
            out[row].append(int(tokens[row]))
        logprobs.append(float(scores[0][0]))
        ids, positions = tokens[:, None], positions + 1
    prompt_logprobs = [s[0].tolist() for s in (*first, second)]
    return {"tokens": out, "logprobs": logprobs, "prompt_logprobs": [x for p in prompt_logprobs for x in p]}


def _graphs_row(run: str, spec, graphs: dict, export_s: float, generate_s: float) -> dict:
    """What a run over exported serving graphs reports first: its graphs' summaries, the experts, the
    times, and the decode graph's bytes per call each way."""
    summaries = [g.summary() for g in graphs.values()]
    (decode,) = [g for g in summaries if g["graph"].endswith(" decode")]
    return {
        "run": run,
        "exported": True,
        "prefill_experts": spec.prefill_experts,
        "decode_experts": spec.decode_experts,
        "graphs": summaries,
        "other_compiles": 0,
        "export_s": export_s,
        "generate_s": generate_s,
        "generation_to_device_bytes_per_decode_call": decode["to_device_bytes_per_call"],
        "generation_to_host_bytes_per_decode_call": decode["to_host_bytes_per_call"],
    }


def check_serving(xla: Xla, port, hlo_dir) -> tuple[dict, dict]:
    """The port's graphs as the batching engine calls them, on XLA and on the CPU with the same
    inputs: (the report row, {graph name: op set})."""
    spec = port.static
    spec = dataclasses.replace(spec, prefill_rows=tuple(sorted({*spec.prefill_rows, 2})))  # two prompts in one call
    bucket, rows = spec.buckets[0], spec.rows_for(spec.batch_size)
    model = build_model(port, spec.decode_experts)
    cache = new_cache(model, spec.max_cache_len, spec.batch_size)
    start = time.perf_counter()
    programs = {
        f"prefill {p}x{bucket}": export(
            Prefill(model, cache, spec.prefill_experts), example_inputs(spec, bucket, p), f"prefill {p}x{bucket}"
        )
        for p in rows
    }
    programs["decode"] = export(Decode(model, cache, spec.decode_experts), example_inputs(spec, None), "decode")
    # the logits-processing variants over the same cache and one set of token counts
    counts = new_counts(model, spec.batch_size)
    for p in rows:
        graph = ProcessingPrefill(model, cache, counts, spec.prefill_experts)
        name = f"prefill processing {p}x{bucket}"
        programs[name] = export(graph, graph_inputs(graph, spec, bucket, p), name)
    graph = ProcessingDecode(model, cache, counts, spec.decode_experts)
    programs["decode processing"] = export(graph, graph_inputs(graph, spec, None), "decode processing")
    export_s = time.perf_counter() - start

    tokenizer = ByteTokenizer()
    long, short = tokenizer.encode(PROMPTS[2])[: 2 * bucket + 3], tokenizer.encode(PROMPTS[-1])[:bucket]
    gen = torch.Generator().manual_seed(0)
    settings = [(0.8, 0, 0.9), (1.0, 20, 1.0), (0.7, 0, 1.0)]  # top-p; top-k; temperature alone
    draws = [(*settings[i % 3], float(torch.rand((), generator=gen))) for i in range(SERVING_TOKENS + 8)]
    pad = port.config.pad_token_id or 0
    cpu_runtime = serving_runtime(None, programs, spec, bucket, None)[0]
    reference = drive(cpu_runtime, long, short, draws, bucket, pad)
    asked, other = tokenizer.encode(PROMPTS[0])[: 2 * bucket - 2], tokenizer.encode(PROMPTS[1])[:bucket]
    processing_reference = drive_processing(cpu_runtime, asked, other, draws)
    runtime, graphs = serving_runtime(xla, programs, spec, bucket, hlo_dir)
    xla.moved()  # not the programs' own move to the device
    start = time.perf_counter()
    got = drive(runtime, long, short, draws, bucket, pad)
    processing = drive_processing(runtime, asked, other, draws)
    generate_s = time.perf_counter() - start
    ids, mask = torch.tensor([long]), torch.ones(1, len(long), dtype=torch.long)
    eager = greedy(build_model(port, "eager", torch.float32), ids, mask, SERVING_TOKENS).tokens[0].tolist()
    row = _graphs_row(SERVING, spec, graphs, export_s, generate_s)
    summaries = row["graphs"]
    (decode,) = [g for g in summaries if g["graph"].endswith(" decode")]
    (variant,) = [g for g in summaries if g["graph"].endswith(" decode processing")]
    diverged = next((i for i, (a, b) in enumerate(zip(got[0], eager)) if a != b), None)
    row |= {
        "decode_output_bytes_per_call": decode["outputs_bytes_per_call"],
        "decode_token_bytes": spec.batch_size * 8,
        "prompts": {"chunked greedy row": len(long), "sampled row": len(short), "chunk": bucket},
        "sampled_like_cpu": got == reference,
        "tokens": got,
        # the logits-processing variants: the same tokens as on the CPU, the logprobs within fp32 rounding
        "processing_like_cpu": processing["tokens"] == processing_reference["tokens"]
        and all(
            abs(a - b) < 1e-4
            for key in ("logprobs", "prompt_logprobs")
            for a, b in zip(processing[key], processing_reference[key])
        ),
        "processing": processing,
        "processing_decode_bytes": {
            "inputs": variant["inputs_bytes_per_call"],
            "outputs": variant["outputs_bytes_per_call"],
        },
        "vs_cpu_fp32": {
            "all_match": diverged is None,
            "matched": int(diverged is None),
            "first_divergence": [diverged],
        },
    }
    return row, {name: graph_ops(p) for name, p in programs.items()}


PREFIX = "exported, the serving runtime with prefix caching: a held prefix copied into another row"


class _Greedy:
    """A prompt generating `n` tokens greedily in a row of the engine step."""

    def __init__(self, prompt: list[int], n: int):
        self.prompt, self.n, self.tokens = prompt, n, []

    def sampling(self):
        return GREEDY

    def next(self, token, logits):
        self.tokens.append(token)
        return token if len(self.tokens) < self.n else None

    def end(self, error=None):
        if error is not None:
            raise error


def drive_prefix(runtime, first: list[int], second: list[int]) -> tuple[list[list[int]], int]:
    """`first` prefilled in chunks and generating in row 0; once it generates, `second` (sharing its
    first blocks) admitted: (both rows' tokens, the tokens the second took from row 0)."""
    rows = Rows(runtime, prefix=PrefixIndex(runtime.batch, runtime.max_cache_len))
    a, b = _Greedy(first, SERVING_TOKENS), _Greedy(second, SERVING_TOKENS)
    waiting = [a]
    while not a.tokens:
        rows.step(lambda: waiting.pop() if waiting else None)
    hits = rows.prefix.hits
    waiting = [b]
    while rows.active() or waiting:
        rows.step(lambda: waiting.pop() if waiting else None)
    return [a.tokens, b.tokens], rows.prefix.hits - hits


def check_prefix(xla: Xla, port, hlo_dir) -> tuple[dict, dict]:
    """The port's graphs over a whole-row cache, with the copy graph, as the engine step calls them
    with prefix caching, on XLA and on the CPU: (the report row, {graph name: op set})."""
    spec = dataclasses.replace(port.static, prefill_rows=(1,))
    bucket = spec.buckets[0]
    model = build_model(port, spec.decode_experts)
    cache = new_cache(model, spec.max_cache_len, spec.batch_size, whole_rows=True)
    start = time.perf_counter()
    programs = {
        f"prefill 1x{bucket}": export(
            Prefill(model, cache, spec.prefill_experts), example_inputs(spec, bucket, 1), f"prefill 1x{bucket}"
        ),
        "decode": export(Decode(model, cache, spec.decode_experts), example_inputs(spec, None), "decode"),
        "copy": export(Copy(cache), copy_inputs(), "copy"),
    }
    export_s = time.perf_counter() - start
    tokenizer = ByteTokenizer()
    first = tokenizer.encode(PROMPTS[2])[: 2 * BLOCK + 9]  # past the sliding window, a partial last block
    second = first[: 2 * BLOCK] + tokenizer.encode(PROMPTS[-1])  # its first two blocks, then its own
    reference = drive_prefix(serving_runtime(None, programs, spec, bucket, None, copy=True)[0], first, second)
    runtime, graphs = serving_runtime(xla, programs, spec, bucket, hlo_dir, copy=True, tag="prefix")
    xla.moved()
    start = time.perf_counter()
    got, hit = drive_prefix(runtime, first, second)
    generate_s = time.perf_counter() - start
    eager_model = build_model(port, "eager", torch.float32)
    eager = [greedy(eager_model, *left_pad([p], 0), SERVING_TOKENS).tokens[0].tolist() for p in (first, second)]
    row = _graphs_row(PREFIX, spec, graphs, export_s, generate_s)
    diverged = [next((i for i, (x, y) in enumerate(zip(g, e)) if x != y), None) for g, e in zip(got, eager)]
    row |= {
        "prompts": {"first": len(first), "second": len(second), "taken": hit, "chunk": bucket},
        "same_as_cpu": got == reference[0] and hit == reference[1] == 2 * BLOCK,
        "tokens": got,
        "vs_cpu_fp32": {
            "all_match": all(d is None for d in diverged),
            "matched": sum(d is None for d in diverged),
            "first_divergence": diverged,
        },
    }
    return row, {name: graph_ops(p) for name, p in programs.items()}


NEW = "exported, the new graphs: decode by KV length, the step graph, verify (k = 4) and the assistant's draft"
NEW_K = 4  # drafts per verify call: q = k + 1 positions a row
NEW_CHUNK = 24  # the step graph's bucket: a chunk of row 1's prompt beside the decode of every row
ASSISTANT = "tiny-gemma4-moe-assistant"  # the built-in assistant of the tiny port


def _read_only_export(graph, inputs: tuple, what: str) -> torch.export.ExportedProgram:
    """torch.export (strict, functional) of a graph that `export`'s state check does not describe: the
    verify graph returning the hidden state an assistant reads, the draft graph that writes no state;
    refused with a data-dependent op all the same."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message="While (compiling|exporting), we found certain side effects")
        program = functional(torch.export.export(graph, inputs, strict=True))
    bad = data_dependent_ops(program)
    if bad:
        raise GraphError(f"{what}: data-dependent ops in the exported graph: {sorted(set(bad))}")
    return program


def new_programs(port, config) -> tuple[dict, float]:
    """The port's new graphs over one cache (with the slack of k drafts and the assistant's read):
    the prefill of the longest bucket, the decode graphs of the shortest KV length and of the whole
    cache, the step graph of NEW_CHUNK, the verify graph of k (returning the hidden state) and the
    assistant's draft graph of k; (the programs, the seconds their export took)."""
    spec = port.static
    model = build_model(port, spec.decode_experts)
    assistant = load_assistant(check_assistant(config, model.config), model)
    cache = new_cache(model, spec.max_cache_len, spec.batch_size, slack=NEW_K + 1)
    bucket, short, rows = spec.buckets[-1], min(spec.decode_lengths), spec.batch_size
    start = time.perf_counter()
    decode = example_inputs(spec, None)
    programs = {
        f"prefill 1x{bucket}": export(
            Prefill(model, cache, spec.prefill_experts), example_inputs(spec, bucket, 1), f"prefill 1x{bucket}"
        ),
        f"decode {short}": export(Decode(model, cache, spec.decode_experts, span=short), decode, f"decode {short}"),
        "decode": export(Decode(model, cache, spec.decode_experts), decode, "decode"),
        f"step 1x{NEW_CHUNK}": export(
            Step(model, cache, spec.prefill_experts), example_inputs(spec, NEW_CHUNK, 1) + decode, "step"
        ),
        "verify": _read_only_export(
            Verify(model, cache, spec.decode_experts, hidden=True), verify_inputs(rows, NEW_K + 1), "verify"
        ),
        "draft": _read_only_export(
            Draft(assistant, model, cache, NEW_K),
            (decode[0], torch.zeros(rows, model.config.hidden_size), decode[1]),
            "draft",
        ),
    }
    return programs, time.perf_counter() - start


def new_runtime(xla: Xla | None, programs: dict, spec, config, hlo_dir) -> tuple[GraphRuntime, dict]:
    """The new graphs behind the engine's runtime, on XLA (metered) or on the CPU (xla None): the
    decode graphs by KV length, prefill calls routed by their shape."""
    graphs, on = placed(xla, programs, hlo_dir, "new")
    short = min(spec.decode_lengths)

    def prefill(*args):
        return on(graphs[f"prefill {args[0].shape[0]}x{args[0].shape[1]}"])(*args)

    shapes = dataclasses.replace(spec.shapes(), buckets=(NEW_CHUNK, spec.buckets[-1]), prefill_rows=(1,))
    runtime = GraphRuntime(
        prefill,
        {short: on(graphs[f"decode {short}"]), None: on(graphs["decode"])},
        shapes,
        logits=False,
        candidates=CANDIDATES,
        vocab=VOCAB,
        verify=on(graphs["verify"]),
        speculative=config,
        draft=on(graphs["draft"]),
        step=on(graphs[f"step 1x{NEW_CHUNK}"]),
    )
    return runtime, graphs


def drive_new(runtime, first: list[int], second: list[int], draws: list[tuple], pad: int) -> dict:
    """Row 0 greedy, row 1 sampled (draws[i] its i-th draw). Row 0: `first` prefilled whole; row 1:
    `second` in chunks of NEW_CHUNK by the step graph, each beside a decode of every row (row 1 a pad
    at the end of its chunk); both then decode, row 0 from below the shortest decode graph's length
    to past it (that graph, then the whole cache's); then VERIFY_ROUNDS verify calls, the first of
    prompt lookup's drafts (as the engine step, a plain decode step while no row has one), each later
    one of the assistant's (the draft graph from the hidden state at the column of the row's last
    accepted token). -> what each call gave, and the rows' tokens."""
    draws, short = iter(draws), runtime.decode_starts[1]  # the shortest decode graph's length
    context = [list(first), list(second)]
    calls = {"decode lengths": [], "accepted": [], "drafts": [], "verify": []}
    (token,), _ = runtime.prefill([Chunk(first, 0, 0, GREEDY)])
    context[0].append(int(token))
    for done in range(0, len(second), NEW_CHUNK):
        piece = second[done : done + NEW_CHUNK]
        ids = torch.tensor([[context[0][-1]], [pad]])
        positions = torch.tensor([[len(context[0]) - 1], [done + len(piece)]])
        last = done + len(piece) == len(second)  # the last chunk's token is row 1's first, sampled
        sampling = next(draws) if last else GREEDY
        chunk, _, tokens, _ = runtime.step(
            [Chunk(piece, done, 1, sampling)], ids, positions, torch.tensor([GREEDY, GREEDY])
        )
        context[0].append(int(tokens[0]))
    context[1].append(int(chunk[0]))
    while len(context[0]) <= short + 2:  # the last two steps past the shorter graph's positions
        _decode_step(runtime, context, draws, calls)
    hidden = None
    for _ in range(VERIFY_ROUNDS):
        if hidden is None:
            drafts = [ngram_propose(c, NEW_K, 1, 3) for c in context]
            for _ in range(LOOKUP_WAIT):
                if any(drafts):
                    break
                _decode_step(runtime, context, draws, calls)
                drafts = [ngram_propose(c, NEW_K, 1, 3) for c in context]
        else:
            last, positions = torch.tensor([c[-1] for c in context]), torch.tensor([len(c) - 1 for c in context])
            drafts = runtime.draft(last, hidden, positions)[0].tolist()
        calls["drafts"].append(drafts)
        hidden = _verify(runtime, context, drafts, draws, pad, calls)
    return {"calls": calls, "tokens": [c[len(p) :] for c, p in zip(context, (first, second))]}


LOOKUP_WAIT = 8  # plain decode steps at most while prompt lookup drafts nothing for any row


def _decode_step(runtime, context: list[list[int]], draws, calls: dict) -> None:
    """A decode step of both rows (row 0 greedy, row 1 sampled), routed by KV length; each row's context
    extended by its token."""
    ids = torch.tensor([[c[-1]] for c in context])
    positions = torch.tensor([[len(c) - 1] for c in context])
    calls["decode lengths"].append(runtime.decode_length(positions))
    tokens, _ = runtime.decode(ids, positions, torch.tensor([GREEDY, next(draws)]))
    for row, c in enumerate(context):
        c.append(int(tokens[row]))


VERIFY_ROUNDS = 4


def _verify(runtime, context: list[list[int]], drafts: list[list[int]], draws, pad: int, calls: dict):
    """One verify call of each row's fed token and its drafts (row 0 greedy, row 1 sampled: a draw per
    column), each row's context extended by the tokens it took -> the hidden state at the column of each
    row's last accepted token."""
    q = NEW_K + 1
    ids = torch.full((len(context), q), pad, dtype=torch.long)
    drafted, uniforms = torch.zeros(len(context), dtype=torch.long), torch.zeros(len(context), q)
    sampling = torch.tensor([GREEDY, next(draws)])
    for row, (c, d) in enumerate(zip(context, drafts)):
        ids[row, 0], ids[row, 1 : 1 + len(d)], drafted[row] = c[-1], torch.tensor(d, dtype=torch.long), len(d)
    uniforms[1] = torch.tensor([float(sampling[1, 3]), *(next(draws)[3] for _ in range(q - 1))])
    positions = torch.tensor([[len(c) - 1] for c in context]) + torch.arange(q)
    tokens, accepted, _, hidden = runtime.verify(ids, positions, sampling, drafted, uniforms)
    calls["accepted"].append(accepted.tolist())
    calls["verify"].append(tokens.tolist())
    for row, c in enumerate(context):
        c.extend(tokens[row, : int(accepted[row]) + 1].tolist())
    return hidden[torch.arange(len(context)), accepted]


def check_new(xla: Xla, port, hlo_dir) -> tuple[dict, dict]:
    """The new graphs as the engine calls them, on XLA and on the CPU with the same inputs: (the report
    row, {graph name: op set})."""
    spec = port.static
    config = SpeculativeConfig("mtp", NEW_K, model=ASSISTANT)
    programs, export_s = new_programs(port, config)
    tokenizer = ByteTokenizer()
    first, second = tokenizer.encode(PROMPTS[2]), tokenizer.encode(PROMPTS[3])
    gen = torch.Generator().manual_seed(0)
    settings = [(0.8, 0, 0.9), (1.0, 20, 1.0), (0.7, 0, 1.0)]  # top-p; top-k; temperature alone
    draws = [(*settings[i % 3], float(torch.rand((), generator=gen))) for i in range(128)]
    pad = port.config.pad_token_id or 0
    reference = drive_new(new_runtime(None, programs, spec, config, None)[0], first, second, draws, pad)
    runtime, graphs = new_runtime(xla, programs, spec, config, hlo_dir)
    xla.moved()  # not the programs' own move to the device
    start = time.perf_counter()
    got = drive_new(runtime, first, second, draws, pad)
    generate_s = time.perf_counter() - start
    ids, mask = torch.tensor([first]), torch.ones(1, len(first), dtype=torch.long)
    greedy_row = got["tokens"][0]
    eager = greedy(build_model(port, "eager", torch.float32), ids, mask, len(greedy_row)).tokens[0].tolist()
    diverged = next((i for i, (a, b) in enumerate(zip(greedy_row, eager)) if a != b), None)
    row = _graphs_row(NEW, spec, graphs, export_s, generate_s)
    row |= {
        "prompts": {"prefilled row": len(first), "stepped row": len(second), "chunk": NEW_CHUNK, "k": NEW_K},
        "same_as_cpu": got == reference,
        "calls": got["calls"],
        "tokens": got["tokens"],
        "vs_cpu_fp32": {
            "all_match": diverged is None,
            "matched": int(diverged is None),
            "first_divergence": [diverged],
        },
    }
    return row, {name: graph_ops(p) for name, p in programs.items()}


def _vs_quantized(row: dict) -> str | None:
    """The row's key of its SEQ_MATCH against the same quantized model on the CPU, if it has one."""
    return next((k for k in row if k.startswith("vs_cpu_") and k != "vs_cpu_fp32"), None)


def passed(row: dict) -> bool:
    clean = all(
        g["compiles_first_call"] <= 1 and g["compiles_later_calls"] == 0 and not g["aten_fallbacks"]
        for g in row["graphs"]
    )
    quantized = _vs_quantized(row)
    tokens = row[quantized]["all_match"] if quantized else row["vs_cpu_fp32"]["all_match"]
    if row["run"] == SERVING:  # and the sampled row as the CPU samples it, and a decode call returns its tokens only
        tokens = tokens and row["sampled_like_cpu"] and row["decode_output_bytes_per_call"] == row["decode_token_bytes"]
        tokens = tokens and row["processing_like_cpu"]
    if row["run"] in (PREFIX, NEW):  # and every token as the CPU's (the prefix taken, the drafts, the accepted)
        tokens = tokens and row["same_as_cpu"]
    if row["run"] == NEW:  # and prompt lookup's drafts were verified, not only the assistant's
        tokens = tokens and any(row["calls"]["drafts"][0])
    return clean and tokens


def _step_bytes(row: dict) -> dict:
    """A run's bytes per decode call: the call's own inputs/outputs, and what XLA moved."""
    (decode,) = [g for g in row["graphs"] if g["graph"].endswith(" decode")]
    return {
        "inputs": decode["inputs_bytes_per_call"],
        "outputs": decode["outputs_bytes_per_call"],
        "to_device": decode["to_device_bytes_per_call"],
        "to_host": decode["to_host_bytes_per_call"],
        "all_to_device": row["generation_to_device_bytes_per_decode_call"],
        "all_to_host": row["generation_to_host_bytes_per_decode_call"],
    }


def before_after(baseline: dict, result: dict) -> list[str]:
    """The decode step's bytes, the baseline checkout's first run beside this one's."""
    rows = [
        dict(_step_bytes(baseline["runs"][0]), code=f"before: {baseline['code']}"),
        dict(_step_bytes(result["runs"][0]), code=f"after: {result['code']}"),
    ]
    return [
        "## Bytes per decode step: before and after",
        "",
        f"Run: {result['runs'][0]['run']}; batch {result['batch_size']}. *call inputs / outputs*: the bytes of "
        "the decode call's own arguments and results — on Neuron, what NxD's runtime copies between host and "
        "device for every input and for every output that is not an aliased state. *XLA host→device / "
        "device→host*: torch-xla's `OutboundData` / `InboundData` from the end of the previous graph call to the end "
        "of this one (the host makes the call's inputs in between), the median over the decode calls; *whole "
        "generation*: everything the generation moved (the prefills, and the tokens and logits read at the end, "
        "included) divided by its decode calls. On XLA:CPU a graph output stays on the device until read, so the "
        "old graphs' KV round trip shows in the call's inputs/outputs (what an NxD runtime would copy), not in "
        "XLA's transfers; their logits show in the whole generation's device→host bytes.",
        "",
        report.table(
            rows,
            [
                ("code", "code"),
                ("inputs", "call inputs", "{:.0f}"),
                ("outputs", "call outputs", "{:.0f}"),
                ("to_device", "XLA host→device", "{:.0f}"),
                ("to_host", "XLA device→host", "{:.0f}"),
                ("all_to_device", "whole generation host→device", "{:.0f}"),
                ("all_to_host", "whole generation device→host", "{:.0f}"),
            ],
            markdown=True,
        ),
        "",
    ]


def _graph_table(row: dict) -> list[str]:
    """A run's graphs, a markdown row each."""
    lines = [
        "| graph | calls | compiles, 1st call | compiles, later calls | aten fallbacks "
        "| HLO sort / custom-call / while / conditional | call in / out bytes "
        "| XLA host→device / device→host bytes | 1st call s | later call ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in row["graphs"]:
        fb = ", ".join(f"{k} ×{v}" for k, v in g["aten_fallbacks"].items()) or "none"
        later = "-" if g["later_call_ms"] is None else f"{g['later_call_ms']:.1f}"
        first = f"{g['compiles_first_call']}" + (
            " (cached: same HLO as an earlier run)" if g["cache_hit_first_call"] else ""
        )
        lines.append(
            f"| {g['graph'].split(' ', 1)[1]} | {g['calls']} | {first} | "
            f"{g['compiles_later_calls']} | {fb} | {' / '.join(map(str, g['hlo_ops'].values())) or '-'} | "
            f"{g['inputs_bytes_per_call']:.0f} / {g['outputs_bytes_per_call']:.0f} | "
            f"{g['to_device_bytes_per_call']:.0f} / {g['to_host_bytes_per_call']:.0f} | "
            f"{g['first_call_s']:.1f} | {later} |"
        )
    return lines


def _serving_lines(row: dict) -> list[str]:
    """What the serving run drove and found, beyond the SEQ_MATCH line."""
    p = row["prompts"]
    return [
        f"- row 0: a {p['chunked greedy row']}-token prompt prefilled in chunks of {p['chunk']} between "
        f"decode steps, then greedy (the SEQ_MATCH line above is its tokens vs HF eager); row 1: a "
        f"{p['sampled row']}-token prompt prefilled beside row 0's first chunk in one call, then sampled "
        "in the graphs (top-p 0.9, top-k 20, temperature alone, in turn, each token its own draw)",
        f"- every token equal to the same programs' on the CPU given the same inputs: **{row['sampled_like_cpu']}**",
        f"- a decode call returns **{row['decode_output_bytes_per_call']:.0f} bytes**: the "
        f"{row['decode_token_bytes'] // 8} token ids (int64), no logits",
        "- the logits-processing variants (a row that asks: penalties, min_p, a logit bias, two banned ids "
        "and a bitmask of the even tokens; prefilled in two chunks but for its prompt's last token, which "
        "its first variant decode is fed; beside a row that asks nothing, greedy, in the same calls; "
        "each variant prefill graph called): tokens and "
        f"logprobs (the prompt's too) as on the CPU: **{row['processing_like_cpu']}**; a variant decode "
        f"call takes {row['processing_decode_bytes']['inputs']:.0f} bytes and returns "
        f"{row['processing_decode_bytes']['outputs']:.0f} (the plain decode's: "
        f"{_step_bytes(row)['inputs']:.0f} and {_step_bytes(row)['outputs']:.0f})",
    ]


def _prefix_lines(row: dict) -> list[str]:
    """What the prefix-caching run drove and found, beyond the SEQ_MATCH line."""
    p = row["prompts"]
    return [
        f"- row 0: a {p['first']}-token prompt (past the sliding window, a partial last block) prefilled in "
        f"chunks of {p['chunk']}, then greedy; once it generates, row 1: a {p['second']}-token prompt whose "
        f"first {p['taken']} tokens row 0 holds, copied into row 1 by the copy graph, the rest prefilled "
        "from there, then greedy (the SEQ_MATCH line above: both rows' tokens vs HF eager)",
        f"- every token (and the prefix taken) equal to the same programs' on the CPU: **{row['same_as_cpu']}**",
    ]


def _new_lines(row: dict) -> list[str]:
    """What the run of the new graphs drove and found, beyond the SEQ_MATCH line."""
    p, calls = row["prompts"], row["calls"]
    lengths = calls["decode lengths"]
    short = min(n for n in lengths if n is not None)
    drafted = [[len(d) for d in drafts] for drafts in calls["drafts"]]
    return [
        f"- row 0 (greedy): a {p['prefilled row']}-token prompt prefilled whole; row 1 (sampled): a "
        f"{p['stepped row']}-token prompt in chunks of {p['chunk']} by the step graph, each call also the "
        "decode of every row (row 1 a pad at the end of its chunk); the SEQ_MATCH line above is row 0's "
        "tokens vs HF eager",
        f"- decode calls: {lengths.count(short)} of the {short}-position graph, then "
        f"{lengths.count(None)} of the whole cache's once row 0 passed position {short - 1}",
        f"- {len(calls['verify'])} verify calls of q = {p['k'] + 1} (row 0 greedy, row 1 sampled, a draw a column): "
        f"the first of prompt lookup's drafts, each later one of the assistant's {p['k']} (the draft graph, from "
        f"the verify graph's hidden state); drafts per row {drafted}, accepted per row {calls['accepted']}",
        f"- every token, draft and acceptance equal to the same programs' on the CPU: **{row['same_as_cpu']}**",
    ]


def _run_section(row: dict) -> list[str]:
    """One run's section: its graphs, its tokens against the references, what it moved, its verdict."""
    fp32 = row["vs_cpu_fp32"]
    n = 1 if row["run"] in (SERVING, NEW) else 2 if row["run"] == PREFIX else len(PROMPTS)
    lines = [f"## {row['run']}", "", *_graph_table(row)]
    lines += [
        "",
        f"- SEQ_MATCH vs CPU fp32 reference (HF eager): **{fp32['all_match']}** "
        f"({fp32['matched']}/{n}; first divergence per prompt {fp32['first_divergence']})",
    ]
    if _vs_quantized(row):
        q, name = row[_vs_quantized(row)], _vs_quantized(row).removeprefix("vs_cpu_")
        lines.append(
            f"- SEQ_MATCH vs the same {name} model on the CPU (HF, {name} on every linear): **{q['all_match']}** "
            f"({q['matched']}/{len(PROMPTS)}; first divergence per prompt {q['first_divergence']})"
        )
    if row["run"] == SERVING:
        lines += _serving_lines(row)
    if row["run"] == PREFIX:
        lines += _prefix_lines(row)
    if row["run"] == NEW:
        lines += _new_lines(row)
    export = "" if row["export_s"] is None else f"export {row['export_s']:.0f} s, "
    return lines + [
        f"- bytes the whole generation moved, per decode call: host→device "
        f"{row['generation_to_device_bytes_per_decode_call']:.0f}, device→host "
        f"{row['generation_to_host_bytes_per_decode_call']:.0f}",
        f"- wall: {export}generation {row['generate_s']:.1f} s (compiles included); "
        f"{row['other_compiles']} compilation(s) outside the graphs (collecting the tokens for the host)",
        f"- verdict: {'PASS' if row['passed'] else 'FAIL'}",
        "",
    ]


NOTES = [
    "- Bytes per call are the median over the graph's calls, XLA's from the end of the previous graph call to the "
    "end of this one. A call's inputs made on the host (ids, pad mask, positions, row ids) are what XLA moves to "
    "the device; the fed-back token is already there.",
    "- A first call with 0 compilations found its graph already compiled: the same HLO (same graph, same "
    "weights) ran in an earlier run of this process (torch-xla's `CachedCompile`).",
    "- Each weight format (int8, int4, q4_0 on every linear: experts, attention, dense MLP, lm_head) is compared "
    "with the fp32 reference and with the same quantized model on the CPU; the second is the check of the XLA "
    "lowering (a quantized model's greedy picks leave the float model's). Its tensors are made once on the CPU, "
    "as trace-and-compile writes them; the packed 4-bit numbers are unpacked inside each graph (mask, shift on "
    "int32 words, convert, multiply): those runs hold the ops to the allow-list.",
    "- HLO column (with `--hlo DIR`, which writes each graph's HLO text there; `make xla-check`: "
    "build/xla-check-hlo/): each `sort` is a router's `topk` (one per layer), which torch-xla lowers to a "
    "full sort; a custom-call would be an op outside plain HLO, a while or conditional control flow in the graph.",
    "- What this does not show: that neuronx-cc accepts this HLO (its sort support included), that NxD's "
    "runtime keeps the aliased state on the device as its source says, or anything about speed on a Neuron "
    "device. Times above are XLA:CPU on the host that ran this.",
    "",
]


def markdown(result: dict, baseline: dict | None = None) -> str:
    """The page of a check's JSON (`baseline`: another checkout's, its decode bytes shown beside)."""
    env = result["environment"]
    lines = [
        "# XLA lowering check (torch-xla on CPU)",
        "",
        f"Machine: {env['machine']} — CPU only, `PJRT_DEVICE=CPU` (XLA:CPU; no Neuron device, no neuronx-cc).",
        f"Packages: Python {env['python']}, torch {env['torch']}, torch-xla {env['torch_xla']}, "
        f"transformers {env['transformers']}. Port `{result['port']}` ({result['weights']})"
        + (
            f", {len(PROMPTS)} prompts in batches of {result['batch_size']}, "
            f"prefill + {result['new_tokens'] - 1} decode steps."
            if not result.get("only")
            else f", batch {result['batch_size']}."
        ),
        "",
        "Written by `make xla-check` (`python -m bench.xla_check`). Compilations from `CompileTime`, fallbacks are "
        "torch-xla's `aten::*` counters, per graph; a call is one graph call plus `torch_xla.sync()`. The graphs "
        "are the serving graphs: the KV cache is their device state, the token their only output.",
        "",
    ]
    if result.get("only"):
        lines += [f"This page is one run of the check alone (`--only {result['only']}`).", ""]
    if baseline is not None:
        lines += before_after(baseline, result)
    for row in result["runs"]:
        lines += _run_section(row)
    lines += [f"Allow-list: {result['allowlist']}", "", "Notes:", *NOTES]
    return "\n".join(lines)


GRAPH_COLUMNS = [
    ("graph", "graph"),
    ("calls", "calls"),
    ("compiles_first_call", "compiles 1st"),
    ("compiles_later_calls", "compiles later"),
    ("aten_fallbacks", "aten fallbacks"),
    ("inputs_bytes_per_call", "in bytes"),
    ("outputs_bytes_per_call", "out bytes"),
    ("to_device_bytes_per_call", "XLA h->d"),
    ("to_host_bytes_per_call", "XLA d->h"),
]


def _references(port, ids, mask, new_tokens: int) -> dict:
    """The CPU references of the generator runs: HF eager in fp32, and each format's quantized model."""
    return {
        "fp32": greedy(build_model(port, "eager", torch.float32), ids, mask, new_tokens),
        **{
            run.quantization: greedy(
                build_model(port, "eager", torch.float32, quantization=run.quantization, quantized_layers=LAYER_GROUPS),
                ids,
                mask,
                new_tokens,
            )
            for run in RUNS
            if run.quantization != NO_QUANTIZATION
        },
    }


CHECKS = {SERVING: check_serving, PREFIX: check_prefix, NEW: check_new}  # the runs that are not a `Run`


def check_all(xla: Xla, port, args, hlo_dir) -> tuple[list[dict], dict]:
    """Every run, each printed as it ends: (its rows, {"TAG graph": op set} of the exported programs)."""
    runs = {"new": (NEW,), "serving": (SERVING,), "prefix": (PREFIX,)}.get(args.only, (*RUNS, SERVING, PREFIX, NEW))
    tokenizer = ByteTokenizer()
    ids, mask = left_pad([tokenizer.encode(p) for p in PROMPTS], tokenizer.pad_token_id)
    references = {}
    if any(isinstance(run, Run) for run in runs):
        references = _references(port, ids, mask, args.new_tokens)
    rows, ops = [], {}
    for run in runs:
        print(f"== {run if isinstance(run, str) else run.name}", flush=True)
        if run in CHECKS:
            row, run_ops = CHECKS[run](xla, port, hlo_dir)
            tag = CHECKS[run].__name__.removeprefix("check_")
        else:
            row, run_ops = check_run(xla, port, run, ids, mask, args.new_tokens, references, hlo_dir)
            tag = f"{run.prefill}/{run.decode}" + (
                "" if run.quantization == NO_QUANTIZATION else f" {run.quantization}"
            )
        row["passed"] = passed(row)
        rows.append(row)
        for graph, names in run_ops.items():
            ops[f"{tag} {graph}"] = names
        print(report.table(row["graphs"], GRAPH_COLUMNS))
        print(
            f"SEQ_MATCH vs CPU fp32: {row['vs_cpu_fp32']['all_match']}"
            + (
                f"; vs CPU {_vs_quantized(row)[7:]}: {row[_vs_quantized(row)]['all_match']}"
                if _vs_quantized(row)
                else ""
            )
            + f"  -> {'PASS' if row['passed'] else 'FAIL'}",
            flush=True,
        )
    return rows, ops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-gemma4-moe", help="port with a [static] table")
    parser.add_argument("--new-tokens", type=int, default=33, help="tokens per prompt: prefill + N-1 decode steps")
    parser.add_argument("--out", default="bench/results/xla-check", help="result files: OUT.md and OUT.json")
    parser.add_argument("--hlo", metavar="DIR", help="also write each graph's HLO text into DIR")
    parser.add_argument(
        "--only",
        choices=("serving", "prefix", "new"),
        help="run only that run: the serving runtime, prefix caching, or the new graphs (decode by KV length, "
        "step, verify, the assistant's draft); default: every run",
    )
    args = parser.parse_args(argv)

    xla = Xla()
    import transformers

    port = load_port(args.model)
    if port.static is None:
        sys.exit(f"error: port {port.name!r} has no [static] table: it has no static graphs to check")
    rows, ops = check_all(xla, port, args, Path(args.hlo) if args.hlo else None)
    root = Path(report.__file__).resolve().parents[1]  # the checkout the package came from
    result = {
        "port": port.name,
        "weights": f"seeded random weights, seed {port.seed}"
        if port.weights_source == "random"
        else f"checkpoint {port.checkpoint.name}",
        "new_tokens": args.new_tokens,
        "batch_size": port.static.batch_size,
        "code": code(root) or str(root),
        "prompts": list(PROMPTS),
        "only": args.only,
        "passed": all(row["passed"] for row in rows),
        "runs": rows,
        "environment": {
            "machine": f"CPU ({platform.machine()}, {os.cpu_count()} cores shared)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_xla": xla.version,
            "transformers": transformers.__version__,
        },
    }
    # the exported programs' ops: what tools/xla_ops.py makes the allow-list of, once every run passed
    exported = set().union(*ops.values())
    result.update(exported_graphs=sorted(ops), exported_ops=sorted(exported))
    missing = sorted(exported - xla_lowered_ops())
    ok = result["passed"] and not missing
    allowlist = (
        f"every one of the {len(exported)} ops of the exported graphs is on `{XLA_LOWERED_OPS_FILE.name}`"
        if not missing
        else f"ops of the exported graphs missing from the allow-list: {missing} "
        "(`python -m tools.xla_ops` writes it from this run's JSON)"
    )
    print(allowlist)
    result.update(passed=ok, allowlist=allowlist)
    baseline_path = Path(f"{args.out}-baseline.json")
    baseline = (
        report.read_json_object(baseline_path, UserError, f"{baseline_path}: unreadable")
        if baseline_path.is_file()
        else None
    )
    write_results(result, f"{args.out}.json", lambda result: markdown(result, baseline))
    print(f"{'PASS' if ok else 'FAIL'}: written {args.out}.md and {args.out}.json")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:  # a bad --model: one line, as the CLI prints it
        sys.exit(f"error: {e}")

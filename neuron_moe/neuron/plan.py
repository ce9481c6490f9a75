"""inf2 memory planner: what one NeuronCore holds for a port at a TP degree, and whether it fits.

Weights come from the port's meta-device model (`info.meta_model`) cut by the TP layout
(`parallel/layout.py`, in the chosen expert layout); each rank's local shard of a linear of the
quantized layer groups (`--quantized-layers`: spec.LAYER_GROUPS, the routed experts by default) is
charged its format's bytes (`formats/`: `Format.nbytes` of the shard's shape, `--quantization`),
every other tensor bf16 (embeddings too: a lookup reads one row), so the planner and the rank
modules cannot disagree about who owns what or what it weighs. Each rank holds, in bytes:

  experts      1/t of the experts (channel layout: every expert's I/t channels; expert layout: E/t
               experts whole)
  attention    q/o split by heads, k/v split or replicated up to t heads (layout.py)
  dense MLP    1/t of gate/up/down
  router etc.  router, norms and scalars, replicated
  embeddings   1/t of the vocabulary rows; lm_head another 1/t: tied in the checkpoint, but two
               tensors on the device (each parallel layer loads its own), the lm_head in the
               format where its group is quantized, the embeddings bf16
  KV cache     bf16 K and V for batch × length × its KV heads; sliding layers hold the window (every
               position with prefix caching: `prefix_caching`)
  graph        stated estimate of the largest transient of the context-encoding graph at batch ×
               seq, whichever is larger of: the MoE stage's gate_up output and activation,
               B·S × (E·2I/t + E·I/t) in either layout; the attention stage's fp32 scores
               [B, h/t, S, S]; each plus its group's largest linear on the rank dequantised
               where the group is quantized, and any other quantized group's largest linear
               dequantised (lm_head's: 1/t of the vocabulary). A quantized linear is dequantised
               one at a time before its matmul (`Format.dequantize`), to a bf16 weight and, where
               the format packs more than one value a byte, one byte a value more for the unpack,
               whose mask, shift and convert on int32 words are elementwise and counted as fused
               (unfused, its words would take 4 bytes a value): `_dequantised_bytes`, from the
               format's tensors
  runtime      stated reserve (default 1 GiB): the runtime's per-core code (96 MiB documented),
               DMA rings, I/O tensors, collectives buffers

against 16 GiB of HBM per NeuronCore-v2. The plan names what it counts against bf16 weights and
replicated tensors (`savings`: each quantized group in its format, with its bits a weight, scales
included; embeddings and lm_head, each 1/t of the vocabulary's rows), and, at the plan's weights and
reserves, the longest context (steps of SHAPE_STEP) that fits at each batch of SHAPE_BATCHES.

Compile host (`compile_host`): neuronx-cc's peak host memory compiling each key, a stated estimate
from the key's graph size anchored on one public report (COMPILE_HOST_MULTIPLE says how), the
largest key's, and whether the named instance's host memory holds it (a compile host may be another
machine: this is not part of the verdict).

Host memory (`host`): the peak of loading and serving an artifact. The load streams each rank's
pre-sharded weights to its NeuronCore a load group at a time (`artifact.load_streamed`: a decoder
layer, or one tensor outside the layers), so the peak is the serving process and its graphs
(stated reserves) plus HOST_LOAD_COPIES × the largest group of one rank, not the model
(tests/test_artifact_load.py measures a streamed load's peak on CPU); every rank's whole shard at
once is given beside it. A plan on an instance whose host memory the peak exceeds does not fit.

Decode: bytes one rank reads per generated token (all its non-expert weights but the embedding
table, each in its format, its KV cache, and its experts as the decode graph of each expert layout
reads them) and
the HBM-bound floor this implies at half a chip's 820 GiB/s per core (two cores per chip share
it); and the same at each decode length (`decode_by_length`: a decode graph of length L reads the
KV cache up to L). The graphs are those trace-and-compile builds (`parallel/moe.py`): the channel layout's
gathers the batch's B·k experts' I/t channels while its experts implementation (the port's
decode_experts) does at that batch (`spec.Experts.gathers`: selective, while B·k < E), else computes
all E experts' channels; the expert layout's computes all its E/t experts.

With a reader budget (`--reader --budget`), the channel layout's decode graph with the reader
(`parallel/reader.py`) is a row of its own: per token, layer and rank its sketch, norms, k_r exact
channels and recovery on the rank's I/t channels (`reader.accounting.rank_geometry`); each rank
then also holds its sidecar shard (`reader_sidecar`).

Host: bytes crossing between host and device per decode step of the built graphs (`neuron/compile.py`):
int64 input_ids and position_ids [batch, 1] and fp32 sampling [batch, 4] in, the token the graph
chose [batch, 1] out; the KV cache is device state (0), and the logits come out only from an
artifact built with --with-logits. A step where some row asks for logprobs, penalties, logit_bias,
min_p, bans or a grammar runs the logits-processing decode instead, whose added inputs and outputs
are rows of their own (`when`: a row asks); a step where none does crosses the plain decode's bytes
alone. Not measured:
no Neuron device was used for any number here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

from .. import spec
from ..errors import UserError
from ..static.sampling import BIAS_WIDTH, TOP_LOGPROBS
from ..formats import Format, format_of, get
from ..info import meta_model, parameter_group
from .artifact import DECODE_KEYS, is_processing, key_names, key_shape, load_group, prefill_key
from ..parallel import layout
from ..reader.accounting import rank_geometry, reads, resident, solve_rank_k
from ..reader.geometry import Geometry
from ..report import table
from ..run_config import RunConfig
from ..hub import check_assistant

GB, GiB = 1e9, 2**30
CORE_HBM = 16 * GiB
CHIP_HBM_BW = 820 * GiB  # bytes/s per Inferentia2 chip (Neuron docs, inferentia2 architecture)
CORES_PER_CHIP = 2
DEFAULT_RUNTIME_RESERVE = spec.DEFAULT_RUNTIME_RESERVE_GIB * GiB
QUANTIZATIONS = spec.QUANTIZATIONS  # the formats planned, of the quantized layer groups (the rest: bf16)
BF16 = 2  # bytes of a bf16 value
# Host memory of a serving process (stated estimates, not measurements): the Python process with
# torch, torch-neuronx, NxD and the server imported, and the compiled graphs (model.pt) it holds.
HOST_PROCESS_RESERVE = 3 * GiB
HOST_GRAPHS_RESERVE = 1 * GiB
# The streamed load (`artifact.load_streamed`) holds one load group of one rank at a time: its
# host buffer and, while it is copied to the device, the runtime's staging copy of it.
HOST_LOAD_COPIES = 2
# neuronx-cc's peak host memory compiling one key (`compile_host`): a stated estimate, NOT a measurement.
# Its model: COMPILE_HOST_MULTIPLE × the key's graph, the bytes of its rank's weights plus its largest
# activation (the graph row's estimate at the key's rows × tokens), on the view that the compiler's
# working set grows with the tensors it tiles. The multiple comes from the one public data point:
# NxDI's Gemma-4 31B port for inf2 (aws-neuron/neuronx-distributed-inference PR #106, TP 16) reports
# "seq_len=16384: CTE compilation runs out of host memory" on a 128 GB host (taken as 128 GiB). That
# key's graph: 30.7e9 bf16 parameters over 16 ranks (3.84 GB) and, its largest activation, one global
# layer's fp32 attention scores, 32 / 16 heads a rank × 16384² × 4 B (2.15 GB). The multiple is the least
# whole one at which that graph needs more than 128 GiB: a floor from one failure, not a fit.
COMPILE_ANCHOR_GRAPH_BYTES = 30.7e9 * 2 / 16 + (32 // 16) * 16384**2 * 4
COMPILE_ANCHOR_HOST = 128 * GiB
COMPILE_HOST_MULTIPLE = math.ceil(COMPILE_ANCHOR_HOST / COMPILE_ANCHOR_GRAPH_BYTES)  # 23
SHAPE_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # the batches the plan's largest-shape table tries
SHAPE_STEP = 128  # context lengths it tries: multiples of this


@dataclass(frozen=True)
class Instance:
    name: str
    chips: int
    host_memory: int  # bytes

    @property
    def cores(self) -> int:
        return self.chips * CORES_PER_CHIP


# Neuron SDK docs, inf2 architecture: 2 NeuronCores and 32 GiB of HBM per chip; the host's memory
INSTANCE_HOST_MEMORY = {
    "inf2.xlarge": 16 * GiB,
    "inf2.8xlarge": 128 * GiB,
    "inf2.24xlarge": 384 * GiB,
    "inf2.48xlarge": 768 * GiB,
}
INSTANCES = {name: Instance(name, chips, INSTANCE_HOST_MEMORY[name]) for name, chips in spec.INSTANCE_CHIPS.items()}
Layers = tuple[str, ...]  # quantized layer groups (spec.LAYER_GROUPS)


def _rank_shards(
    config: Gemma4TextConfig, tp: int, expert_layout: str
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each weight's local shard on one rank (every rank holds the same amount): (shape, dtype), the
    floats bf16, the SPMDRanks int32."""
    state = meta_model(config).state_dict()  # tied embed_tokens / lm_head appear under both names
    full = layout.parallel_state_dict(state, config, tp, expert_layout)
    out = {}
    for name, w in full.items():
        local = layout.shard(w, layout.placement(name, expert_layout), tp, 0)
        out[name] = tuple(local.shape), torch.bfloat16 if local.is_floating_point() else local.dtype
    return out


def _rank_tensors(
    config: Gemma4TextConfig,
    tp: int,
    quantization: str,
    expert_layout: str,
    layers: Layers = spec.DEFAULT_QUANTIZED_LAYERS,
) -> dict[str, int]:
    """Bytes of each weight on one rank: its local shard in its format (`formats/`: `layers` in
    `quantization`, the rest as `_rank_shards` has them)."""
    out = {}
    for name, (shape, dtype) in _rank_shards(config, tp, expert_layout).items():
        try:
            out[name] = format_of(name, quantization, layers).nbytes(shape, dtype)
        except UserError as e:
            what = f"{quantization} {spec.layer_group(name)}"
            raise UserError(f"{what}: {e} ({name} on each of {tp} ranks, {expert_layout} layout)") from None
    return out


def _layer_groups(tensors: dict[str, int]) -> dict[str, int]:
    """`_rank_tensors`' bytes summed by layer group (spec.layer_group: the linears --quantized-layers names)."""
    out: dict[str, int] = {}
    for name, nbytes in tensors.items():
        group = spec.layer_group(name)
        if group is not None:
            out[group] = out.get(group, 0) + nbytes
    return out


def _dequantised_bytes(fmt: Format, shape: tuple[int, ...]) -> int:
    """Transient bytes of a weight of `shape` in `fmt` dequantised in the graph (`Format.dequantize`,
    before its matmul): none where the format holds the weight as it is (its values, its first
    tensor, are the bf16 weight); else the bf16 weight and, where its values pack more than one to
    a byte (fewer elements than the weight), one byte a value more for the unpack (fused)."""
    values, dtype = fmt.shapes(shape, torch.bfloat16)[fmt.tensors[0]]
    numel = math.prod(shape)
    if dtype == torch.bfloat16 and tuple(values) == tuple(shape):
        return 0
    return numel * (BF16 + (1 if math.prod(values) < numel else 0))


def _dequantised(config: Gemma4TextConfig, tp: int, quantization: str, expert_layout: str, layers: Layers) -> dict:
    """For each quantized layer group, the largest transient of one of its linears on a rank dequantised
    (`_dequantised_bytes`): the graph row's (the linears are dequantised one at a time)."""
    fmt, out = get(quantization), {}
    for name, (shape, _) in _rank_shards(config, tp, expert_layout).items():
        group = spec.layer_group(name)
        if group in layers:
            out[group] = max(out.get(group, 0), _dequantised_bytes(fmt, shape))
    return out


def _weights_per_rank(tensors: dict[str, int]) -> dict[str, float]:
    """Bytes of weights on one rank, by group (`tensors`: a rank's bytes of each weight, `_rank_tensors`)."""
    out: dict[str, float] = {}
    for name, nbytes in tensors.items():
        # the experts' SPMDRank is a scalar, not expert weights: it counts where a block's scalars do
        group = (
            "lm_head"
            if name == "lm_head.weight"
            else parameter_group(name.replace(".experts.spmd_rank.", ".spmd_rank."))
        )
        out[group] = out.get(group, 0) + nbytes
    return out


def _host(tensors: dict[str, int], tp: int, inst: Instance | None) -> dict:
    """Peak host memory of loading and serving the artifact: the process and its graphs (stated
    reserves) and the streamed load's buffers, HOST_LOAD_COPIES × the largest load group of one
    rank (`artifact.load_group`: a decoder layer, or a tensor outside the layers; `tensors`: a
    rank's bytes of each weight, `_rank_tensors`)."""
    groups: dict[str, int] = {}
    for name, nbytes in tensors.items():
        groups[load_group(name)] = groups.get(load_group(name), 0) + nbytes
    largest = max(groups, key=groups.get)
    peak = HOST_PROCESS_RESERVE + HOST_GRAPHS_RESERVE + HOST_LOAD_COPIES * groups[largest]
    rank_weights = sum(groups.values())
    host = {
        "process_bytes": HOST_PROCESS_RESERVE,
        "graphs_bytes": HOST_GRAPHS_RESERVE,
        "largest_load_group": largest,
        "largest_load_group_bytes": groups[largest],
        "load_copies": HOST_LOAD_COPIES,
        "peak_bytes": peak,
        "whole_shards_peak_bytes": HOST_PROCESS_RESERVE + HOST_GRAPHS_RESERVE + tp * rank_weights,
    }
    if inst is not None:
        host.update(memory_bytes=inst.host_memory, fits=peak <= inst.host_memory, margin_bytes=inst.host_memory - peak)
    return host


def _compile_host(
    config: Gemma4TextConfig, tp: int, dequantised: dict, weights_bytes: float, keys: dict, inst: Instance | None
) -> dict:
    """neuronx-cc's peak host memory per key (`keys`: name -> (rows, tokens)), COMPILE_HOST_MULTIPLE ×
    (a rank's `weights_bytes` + the key's largest activation, `dequantised` its quantized groups'
    transients), a stated estimate (see the constant); the largest key's, and, where an instance is
    named, whether its host memory holds it."""
    rows = []
    for key, (batch, tokens) in keys.items():
        graph = weights_bytes + _graph_per_rank(config, tp, batch, tokens, dequantised)
        rows.append(
            {
                "key": key,
                "rows": batch,
                "tokens": tokens,
                "graph_bytes": graph,
                "estimate_bytes": COMPILE_HOST_MULTIPLE * graph,
            }
        )
    largest = max(rows, key=lambda r: r["estimate_bytes"])
    out = {
        "multiple": COMPILE_HOST_MULTIPLE,
        "anchor_graph_bytes": COMPILE_ANCHOR_GRAPH_BYTES,
        "anchor_host_bytes": COMPILE_ANCHOR_HOST,
        "keys": rows,
        "largest_key": largest["key"],
        "largest_bytes": largest["estimate_bytes"],
    }
    if inst is not None:
        out.update(memory_bytes=inst.host_memory, fits=largest["estimate_bytes"] <= inst.host_memory)
    return out


def plan_keys(batch: int, seq: int, static=None) -> dict[str, tuple[int, int]]:
    """The keys whose compile `plan` estimates, name -> (rows, tokens): a port's [static] table's plain
    keys (`artifact.key_names`: a decode key per decode length; each logits-processing variant has its
    key's shapes), else one prefill
    of the whole context at once (the graph row's upper bound) and the decode."""
    if static is None:
        return {prefill_key(batch, seq): (batch, seq), DECODE_KEYS[0]: (batch, 1)}
    names = key_names(static.buckets, static.rows_for(batch), spans=static.lengths[:-1])
    return {k: key_shape(k) or (batch, 1) for k in names if not is_processing(k)}


def _largest_shapes(config, tp, weights_bytes: float, dequantised: dict, fixed: float) -> list[dict]:
    """For each of SHAPE_BATCHES, the longest context (a multiple of SHAPE_STEP, at most the model's
    max_position_embeddings) at which a rank's `weights_bytes` (its reader sidecar too), `fixed` bytes
    (the runtime reserve), KV cache and graph estimate (`dequantised`: `_graph_per_rank`'s) still fit a
    NeuronCore; batches at which none fits are left out."""
    rows = []
    for batch in SHAPE_BATCHES:

        def fits(seq):
            used = weights_bytes + fixed + _kv_cache_per_rank(config, tp, batch, seq)
            return used + _graph_per_rank(config, tp, batch, seq, dequantised) <= CORE_HBM

        lo, hi = 0, config.max_position_embeddings // SHAPE_STEP  # the largest n with fits(n·STEP): lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * SHAPE_STEP) else (lo, mid - 1)
        if lo:
            rows.append({"batch": batch, "context": lo * SHAPE_STEP, "tokens": batch * lo * SHAPE_STEP})
    return rows


def _savings(
    config: Gemma4TextConfig,
    tp: int,
    quantization: str,
    expert_layout: str,
    layers: Layers,
    tensors: dict,
    weights: dict,
) -> list[dict]:
    """What this plan counts against bf16 and replicated weights, per rank: each quantized layer group
    in its format (`tensors`: a rank's bytes of each weight, `_rank_tensors`), with its bits a weight,
    scales included; embeddings and lm_head split over the vocabulary."""
    rows = []
    if quantization != spec.NO_QUANTIZATION:
        ours = _layer_groups(tensors)
        bf16 = _layer_groups(_rank_tensors(config, tp, spec.NO_QUANTIZATION, expert_layout))
        for group in layers:
            bits = 8 * ours[group] / (bf16[group] / BF16)
            rows.append(
                {
                    "what": f"{quantization} {group} ({bits:.2f} bits a weight, scales included)",
                    "instead_of": f"bf16 {group}, {bf16[group] / GB:.2f} GB",
                    "saved_bytes": bf16[group] - ours[group],
                }
            )
    if tp > 1:
        vocab = ("embeddings", "lm_head")
        rows.append(
            {
                "what": f"embeddings and lm_head sharded over the vocabulary (1/{tp} of the rows each)",
                "instead_of": "both replicated on every rank",
                "saved_bytes": (tp - 1) * sum(weights[g] for g in vocab),
            }
        )
    return rows


def _kv_cache_per_rank(config: Gemma4TextConfig, tp: int, batch: int, seq: int, whole_rows: bool = False) -> int:
    """`whole_rows`: prefix caching's layout, the sliding layers holding every position too."""
    total = 0
    for i, kind in enumerate(config.layer_types):
        length = min(seq, config.sliding_window) if kind == "sliding_attention" and not whole_rows else seq
        heads = layout.kv_heads_per_rank(config, i, tp)
        total += 2 * batch * length * heads * config.per_layer_config[i].head_dim * 2  # K and V, bf16
    return total


def _graph_per_rank(config: Gemma4TextConfig, tp: int, batch: int, seq: int, dequantised: dict) -> int:
    """The graph row (the module docstring says what it counts): `dequantised`, each quantized layer
    group's largest linear on the rank dequantised (`_dequantised`)."""
    tokens, E, I = batch * seq, config.num_experts // tp, config.moe_intermediate_size
    moe = tokens * E * 3 * I * BF16 + dequantised.get("experts", 0)
    attention = batch * (config.num_attention_heads // tp) * seq * seq * 4 + dequantised.get("attention", 0)
    return max(moe, attention, *dequantised.values())


def _reader_sidecar_per_rank(config: Gemma4TextConfig, tp: int, reader: spec.Reader) -> int:
    """A rank's sidecar shard (`reader/shard.py`): its channels' sketch, norms and b_j, and U, every layer."""
    settings = reader.resolved()
    held = resident(rank_geometry(Geometry.from_config(config), tp), settings)
    return sum(held.values()) * config.num_hidden_layers


def _decode_row(
    config: Gemma4TextConfig,
    tp: int,
    batch: int,
    weights: dict,
    kv: int,
    expert_layout: str,
    decode_experts: spec.Experts | str,
) -> dict:
    """What one layout's decode graph reads per token on one rank (every rank reads the same)."""
    E, I, k = config.num_experts, config.moe_intermediate_size, config.top_k_experts
    rest = sum(v for g, v in weights.items() if g not in ("experts", "embeddings")) + kv
    if expert_layout == layout.EXPERT:
        graph, share = f"all {E // tp} of its experts, whole,", 1.0
    elif spec.experts(decode_experts).gathers(config, batch):
        # a rank holds the same slice of every expert (scales included): B·k of its E slices
        graph, share = f"gathers {batch}×{k} experts' {I // tp} of {I} channels", batch * k / E
    else:
        graph, share = f"all {E} experts' {I // tp} of {I} channels", 1.0
    return _row(expert_layout, graph + " per layer", rest + share * weights["experts"])


def _row(expert_layout: str, graph: str, total: float) -> dict:
    per_core_bw = CHIP_HBM_BW / CORES_PER_CHIP
    return {
        "expert_layout": expert_layout,
        "decode_graph": graph,
        "bytes_per_token": total,
        "GB_per_token": total / GB,
        "floor_ms": 1e3 * total / per_core_bw,
        "tokens_per_s_ceiling": per_core_bw / total,
    }


def _reader_row(config: Gemma4TextConfig, tp: int, batch: int, weights: dict, kv: int, reader: spec.Reader) -> dict:
    """The channel layout's decode graph with the reader (`parallel/reader.py`): per token and layer each
    rank reads its sketch, norms, k_r exact channels and recovery on its own I/t channels
    (`accounting.rank_geometry`); the batch's tokens each select on their own (their reads add up)."""
    geo, settings = Geometry.from_config(config), reader.resolved()
    k = solve_rank_k(geo, settings, reader.budget, tp)
    local = rank_geometry(geo, tp)
    per_layer = sum(reads(local, settings, k).values())
    rest = sum(v for g, v in weights.items() if g not in ("experts", "embeddings")) + kv
    graph = (
        f"reader at {reader.budget:g} %: {batch}×{k} of {config.top_k_experts}×{local.intermediate} channels "
        f"exact, the rest screened (sketch) and recovered, per layer"
    )
    row = _row(layout.CHANNEL, graph, rest + batch * per_layer * config.num_hidden_layers)
    return dict(
        row,
        reader={
            "budget": reader.budget,
            "scan": settings.scan,
            "recovery_rank": settings.recovery_rank,
            "k_per_rank": k,
            "expert_bytes_per_layer": per_layer,
        },
    )


def _decode(
    config, tp, quantization, layers, batch, kv, weights, expert_layout, decode_experts, reader=None
) -> list[dict]:
    """A row per expert layout whose graphs can be built at TP `tp`, this plan's layout (whose
    weights are `weights`) first; with `reader`, the channel layout's decode graph with the reader
    after the channel row."""
    rows = []
    for name in sorted(layout.EXPERT_LAYOUTS, key=lambda n: n != expert_layout):
        try:
            layout.check_degree(config, tp, name)
        except layout.LayoutError:
            continue  # no such graph can be built at this degree
        try:
            held = (
                weights
                if name == expert_layout
                else _weights_per_rank(_rank_tensors(config, tp, quantization, name, layers))
            )
        except UserError:
            continue  # its format's groups do not divide a rank's input channels: no such graph either
        row = _decode_row(config, tp, batch, held, kv, name, decode_experts)
        rows.append(dict(row, this_plan=name == expert_layout and reader is None))
        if reader is not None and name == layout.CHANNEL:
            rows.append(dict(_reader_row(config, tp, batch, held, kv, reader), this_plan=name == expert_layout))
    return rows


def _by_length(config, tp: int, batch: int, kv: int, decode: list[dict], lengths, whole_rows: bool) -> list[dict]:
    """This plan's decode graph (its row of `decode`, which reads the whole cache, `kv` bytes) at each
    decode length: it reads a sliding layer's ring up to the length and a global layer's first length
    positions (`_kv_cache_per_rank` at that length), the rest as the whole cache's graph."""
    this = next(r for r in decode if r["this_plan"] or "reader" in r)
    rows = []
    for length in lengths:
        read = _kv_cache_per_rank(config, tp, batch, length, whole_rows)
        row = _row(this["expert_layout"], this["decode_graph"], this["bytes_per_token"] - kv + read)
        rows.append({"length": length, "kv_bytes": read, **row})
    return rows


ASKS = "a row asks"  # the steps a host_per_step row crosses in: every step, or those of the variant decode


def _host_per_step(config: Gemma4TextConfig, batch: int) -> list[dict]:
    """What crosses the host per decode step (the same on every rank's call: one SPMD program): the
    plain decode's, every step; then what the logits-processing decode adds (`static/decoder.py`
    `ProcessingDecode`), only in a step where some row asks for logprobs, penalties, logit_bias,
    min_p, bans or a grammar (a step where none does runs the plain decode: its bytes alone)."""
    words = -(-config.vocab_size // 32)
    rows = [
        {"what": "KV cache (device state, aliased)", "direction": "-", "bytes": 0},
        {"what": "input_ids + position_ids [B, 1] int64", "direction": "in", "bytes": 2 * batch * 8},
        {
            "what": "sampling [B, 4] fp32 (temperature, top-k, top-p, a uniform draw)",
            "direction": "in",
            "bytes": batch * 4 * 4,
        },
        {"what": "token [B, 1] int64", "direction": "out", "bytes": batch * 8},
        {
            "what": "logits [B, V] fp32 (only an artifact built --with-logits)",
            "direction": "out",
            "bytes": batch * config.vocab_size * 4,
        },
        {
            "what": f"token counts [B, V] fp32 x2 (device state, aliased: {2 * batch * config.vocab_size * 4} bytes)",
            "direction": "-",
            "bytes": 0,
            "when": ASKS,
        },
        {
            "what": "process [B, 7] fp32 (presence, frequency, repetition penalties, min_p, 3 flags)",
            "direction": "in",
            "bytes": batch * 7 * 4,
            "when": ASKS,
        },
        {
            "what": f"logit_bias and bans [B, {BIAS_WIDTH}] int64 ids + fp32 values",
            "direction": "in",
            "bytes": batch * BIAS_WIDTH * (8 + 4),
            "when": ASKS,
        },
        {"what": f"grammar bitmask [B, {words}] int32", "direction": "in", "bytes": batch * words * 4, "when": ASKS},
        {
            "what": f"logprob [B, 1] fp32 + rank [B, 1] int64 + top {TOP_LOGPROBS} ids int64 and logprobs fp32",
            "direction": "out",
            "bytes": batch * (4 + 8 + TOP_LOGPROBS * (8 + 4)),
            "when": ASKS,
        },
    ]
    return [{"when": "every step", **row} for row in rows]


def plan(
    config: Gemma4TextConfig,
    instance: str | None,
    tp: int,
    quantization: str,
    batch: int,
    seq: int,
    runtime_reserve: float = DEFAULT_RUNTIME_RESERVE,
    model: str = "",
    expert_layout: str = layout.DEFAULT_EXPERT_LAYOUT,
    decode_experts: spec.Experts | str = spec.SELECTIVE,
    reader: spec.Reader | None = None,
    prefix_caching: bool = False,
    keys: dict[str, tuple[int, int]] | None = None,
    quantized_layers: Layers = spec.DEFAULT_QUANTIZED_LAYERS,
    speculative=None,
    decode_lengths: tuple[int, ...] | None = None,
) -> dict:
    """The plan for `expert_layout`, `quantized_layers` (spec.LAYER_GROUPS) in `quantization`; its decode
    table has a row for each expert layout that shards at TP `tp`, this plan's first. `decode_experts`: the
    port's [static] decode_experts. `reader` (its budget, scan and recovery rank): the channel layout's
    decode graph with the reader, whose sidecar shard each rank then holds (`reader_sidecar`), and its
    row in the decode table. `instance` None: one NeuronCore's verdict alone, whatever the instance
    (trace-and-compile's check). `prefix_caching`: the KV cache in its whole-row layout (trace-and-compile
    --enable-prefix-caching). `keys` (name -> (rows, tokens); default `plan_keys(batch, seq)`): the graphs
    whose compile host memory it estimates. `speculative` (a `speculative.SpeculativeConfig`): the cache k
    slots longer per layer, and what a verify step reads (`_speculation`). `decode_lengths` (default: seq
    alone): the decode graphs' KV lengths, each with its floor (`decode_by_length`)."""
    inst = INSTANCES[instance] if instance is not None else None
    layers = spec.check_quantized_layers(quantized_layers)
    report = dict(model=model, instance=instance, tp=tp, quantization=quantization, quantized_layers=list(layers))
    report.update(expert_layout=expert_layout, batch=batch, seq=seq, core_hbm_bytes=CORE_HBM)
    report.update(runtime_reserve_bytes=runtime_reserve)
    spec.check_quantization(quantization, QUANTIZATIONS)
    if reader is not None and (expert_layout != layout.CHANNEL or quantization != spec.NO_QUANTIZATION):
        raise UserError(
            f"the reader runs in the channel expert layout's bf16 graphs, not {expert_layout} / {quantization} experts"
        )
    try:
        layout.check_degree(config, tp, expert_layout)
    except layout.LayoutError as e:
        return {**report, "fits": False, "reason": f"not shardable: {e}"}
    tensors = _rank_tensors(config, tp, quantization, expert_layout, layers)
    weights = _weights_per_rank(tensors)
    kv = _kv_cache_per_rank(config, tp, batch, seq, prefix_caching)
    kv += _kv_cache_per_rank(config, tp, batch, speculative.num_speculative_tokens) if speculative else 0  # slack
    dequantised = _dequantised(config, tp, quantization, expert_layout, layers)
    per_rank = {
        **weights,
        "kv_cache": kv,
        "graph": _graph_per_rank(config, tp, batch, seq, dequantised),
        "runtime": runtime_reserve,
    }
    if reader is not None:
        per_rank["reader_sidecar"] = _reader_sidecar_per_rank(config, tp, reader)
    total, held = sum(per_rank.values()), sum(weights.values()) + per_rank.get("reader_sidecar", 0)
    host = _host(tensors, tp, inst)
    fits, reason = _verdict(inst, tp, total, host)
    decode = _decode(config, tp, quantization, layers, batch, kv, weights, expert_layout, decode_experts, reader)
    return {
        **report,
        "fits": fits,
        "reason": reason,
        "per_rank_bytes": per_rank,
        "per_rank_total_bytes": total,
        "experts_all_ranks_bytes": weights["experts"] * tp,
        "margin_per_core_bytes": CORE_HBM - total,
        "savings": _savings(config, tp, quantization, expert_layout, layers, tensors, weights),
        "largest_shapes": _largest_shapes(config, tp, held, dequantised, runtime_reserve),
        "decode": decode,
        "decode_by_length": _by_length(config, tp, batch, kv, decode, decode_lengths or (seq,), prefix_caching),
        "host": host,
        "host_per_step": _host_per_step(config, batch),
        "compile_host": _compile_host(config, tp, dequantised, held, keys or plan_keys(batch, seq), inst),
        **_speculation(config, tp, batch, weights, kv, expert_layout, decode_experts, speculative),
    }


def _speculation(config, tp: int, batch: int, weights: dict, kv: int, expert_layout: str, decode_experts, speculative):
    """What one verify step reads per rank (`decoder.Verify`, the speculation key): the decode graph
    over q = k + 1 positions of every row, so its weights once for B·q tokens (the experts as the
    decode graph reads them at B·q tokens: a gathering graph gathers each token's top-k experts, so
    the experts' share grows with q) and the KV cache (with its slack) once; and its HBM floor per
    token kept, for each count of tokens a step keeps (1: every draft rejected, k + 1: every draft
    accepted and the bonus token). With an assistant, its k draft steps read its weights k times
    (the assistant's own parameters, bf16; its embedding table unused: it reads the target's);
    the draft's KV reads (two of the target's layers) are left out, a small share beside them."""
    if speculative is None:
        return {}
    k, q = speculative.num_speculative_tokens, speculative.num_speculative_tokens + 1
    verify = _decode_row(config, tp, batch * q, weights, kv, expert_layout, decode_experts)
    draft = _assistant_bytes(speculative, config) * k
    step = verify["bytes_per_token"] + draft
    per_core_bw = CHIP_HBM_BW / CORES_PER_CHIP
    return {
        "speculation": {
            "method": speculative.method,
            "num_speculative_tokens": k,
            "verify_graph": verify["decode_graph"] + f" (B·q = {batch}×{q} tokens)",
            "verify_bytes": verify["bytes_per_token"],
            "draft_bytes": draft,
            "step_bytes": step,
            "step_floor_ms": 1e3 * step / per_core_bw,
            "per_kept": [
                {
                    "kept": n,
                    "floor_ms_per_token": 1e3 * step / per_core_bw / n,
                    "tokens_per_s_ceiling": n * per_core_bw / step,
                }
                for n in range(1, q + 1)
            ],
        }
    }


def _assistant_bytes(speculative, config) -> int:
    """An mtp config's assistant, bf16, but its embedding table (0 for prompt lookup): its
    config.json (`hub.check_assistant`) built on the meta device."""
    if speculative.method != "mtp":
        return 0
    directory = check_assistant(speculative, config)
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(Gemma4AssistantConfig.from_pretrained(directory))
    return sum(t.numel() * BF16 for n, t in model.state_dict().items() if "embed_tokens" not in n)


def _verdict(inst: Instance | None, tp: int, total: float, host: dict) -> tuple[bool, str]:
    """(fits, the reason): the instance's NeuronCores for TP `tp` and its host memory for the load's
    peak (`host`), where an instance is named; then one NeuronCore's HBM for a rank's `total` bytes."""
    if inst is not None and tp > inst.cores:
        return False, f"{inst.name} has {inst.cores} NeuronCores; TP {tp} needs {tp}"
    if inst is not None and not host["fits"]:
        return (
            False,
            f"loading needs {host['peak_bytes'] / GiB:.2f} GiB of host memory, {inst.name} has "
            f"{inst.host_memory / GiB:.0f} GiB",
        )
    if total > CORE_HBM:
        return (
            False,
            f"{total / GB:.2f} GB per rank exceeds a NeuronCore's {CORE_HBM / GB:.2f} GB "
            f"(16 GiB) by {(total - CORE_HBM) / GB:.2f} GB",
        )
    host_spare = (
        f"; host peak {host['peak_bytes'] / GiB:.2f} of {inst.host_memory / GiB:.0f} GiB, "
        f"{host['margin_bytes'] / GiB:.2f} GiB spare"
        if inst is not None
        else ""
    )
    return (
        True,
        f"{total / GB:.2f} GB per rank of {CORE_HBM / GB:.2f} GB (16 GiB); "
        f"{(CORE_HBM - total) / GB:.2f} GB spare per core" + host_spare,
    )


def port_plan(port, config: RunConfig, instance: str, runtime_reserve: float = DEFAULT_RUNTIME_RESERVE) -> dict:
    """`plan` for a port at a run configuration: its backend's TP degree, weight format, the layer groups
    in it and reader,
    the expert layout it gives or the port's [static] one, at the port's [static] shapes (without a
    table: the configuration's, else batch 1 and 4096 positions) and decode_experts (without a table:
    the channel layout, selective)."""
    static, backend, shapes = port.static, config.backend, config.shapes
    if backend.reader is not None and backend.reader.budget is None:
        raise UserError("--reader plans the reader's decode graph at a read budget: pass --budget")
    batch, seq = (
        (static.batch_size, static.max_cache_len) if static else (shapes.batch_size or 1, shapes.max_cache_len or 4096)
    )
    expert_layout = backend.placement.expert_layout or (
        static.expert_layout if static else layout.DEFAULT_EXPERT_LAYOUT
    )
    return plan(
        port.config,
        instance,
        backend.placement.tp,
        backend.quantization,
        batch,
        seq,
        runtime_reserve,
        model=port.name,
        expert_layout=expert_layout,
        decode_experts=static.decode_experts if static else spec.SELECTIVE,
        reader=backend.reader,
        keys=plan_keys(batch, seq, static),
        quantized_layers=backend.quantized_layers,
        speculative=config.speculative,
        decode_lengths=static.lengths if static else None,
    )


def _weights_format(report: dict) -> str:
    """How the plan names its weights' formats: bf16, or the quantized layer groups' format."""
    if report["quantization"] == spec.NO_QUANTIZATION:
        return "bf16 weights"
    return f"{report['quantization']} {', '.join(report['quantized_layers'])}, the rest bf16"


def _largest_line(shapes: list[dict]) -> str:
    if not shapes:
        return "\nno batch fits a context of " + f"{SHAPE_STEP}"
    top = max(shapes, key=lambda r: r["tokens"])
    return f"\nlargest batch × context that fits: {top['batch']} × {top['context']} = {top['tokens']} positions"


def render_compile_host(compile_host: dict, instance: str | None) -> str:
    """The compile host's lines of the plan: each key's estimate, the largest, whether `instance` holds it."""
    rows = [
        dict(r, shape=f"{r['rows']} × {r['tokens']}", GB=r["graph_bytes"] / GB, GiB=r["estimate_bytes"] / GiB)
        for r in compile_host["keys"]
    ]
    largest = compile_host["largest_bytes"] / GiB
    verdict = (
        ""
        if "fits" not in compile_host
        else f": {instance}'s {compile_host['memory_bytes'] / GiB:.0f} GiB "
        + ("holds it" if compile_host["fits"] else "does not hold it (compile on a host that does)")
    )
    return "\n".join(
        [
            table(
                rows,
                [("key", "neuronx-cc host memory per key"), ("shape", "rows × tokens"), ("GB", "graph GB", "{:.2f}")]
                + [("GiB", "estimate GiB", "{:.1f}")],
            ),
            f"(a stated estimate, not a measurement: {compile_host['multiple']} × the key's graph, a rank's weights"
            " and its largest activation;\n the multiple is the least at which Gemma-4 31B's 16384-token "
            f"context-encoding key at TP 16 ({compile_host['anchor_graph_bytes'] / GB:.2f} GB)\n needs more than "
            f"{compile_host['anchor_host_bytes'] / GiB:.0f} GiB, from the one public report of neuronx-cc running "
            "out of host memory (NxDI PR #106);\n each logits-processing variant as its key; ModelBuilder compiles "
            "the keys in parallel threads, so their peaks may add)",
            f"compile host: at least {largest:.1f} GiB for {compile_host['largest_key']}{verdict}",
        ]
    )


def _render_by_length(rows: list[dict]) -> str:
    """The decode floor at each decode length (`_by_length`)."""
    columns = [("length", "decode length"), ("kv_GB", "KV GB read/rank", "{:.3f}")]
    columns += [("GB_per_token", "GB/token/rank", "{:.3f}"), ("floor_ms", "HBM floor ms/token", "{:.2f}")]
    return (
        table([dict(r, kv_GB=r["kv_bytes"] / GB) for r in rows], columns)
        + "\n(a decode graph per length: a step runs the smallest above every row's position and reads the KV "
        "cache up to it)\n"
    )


def render_plan(report: dict) -> str:
    lines = [
        f"{report['model']} on {report['instance']}: TP {report['tp']}, "
        f"{_weights_format(report)}, the {report['expert_layout']} expert layout, batch {report['batch']}, "
        f"seq {report['seq']}\n"
    ]
    if "per_rank_bytes" in report:
        rows = [{"what": k, "GB": v / GB} for k, v in report["per_rank_bytes"].items()]
        rows.append({"what": "total", "GB": report["per_rank_total_bytes"] / GB})
        decode = [
            dict(
                r,
                expert_layout=r["expert_layout"]
                + (" + reader" if "reader" in r else "")
                + (" (this plan)" if r["this_plan"] else ""),
            )
            for r in report["decode"]
        ]
        this = next(r for r in report["decode"] if r["this_plan"] or "reader" in r)
        host_rows = _host_rows(report)
        lines += [
            table(rows, [("what", "per rank"), ("GB", "GB", "{:.3f}")]),
            f"\nexperts on all ranks: {report['experts_all_ranks_bytes'] / GB:.2f} GB "
            f"(graph and runtime rows are stated estimates, not measurements)\n",
            table(
                decode,
                [
                    ("expert_layout", "expert layout"),
                    ("decode_graph", "its decode graph reads"),
                    ("GB_per_token", "GB/token/rank", "{:.3f}"),
                    ("floor_ms", "HBM floor ms/token", "{:.2f}"),
                    ("tokens_per_s_ceiling", "tokens/s ceiling", "{:.1f}"),
                ],
            ),
            "\n(decode: the graphs trace-and-compile builds, at this batch; bytes read, not measured)\n",
            f"HBM-bound floor per token (this plan's decode graph, {CHIP_HBM_BW / CORES_PER_CHIP / GiB:.0f} GiB/s "
            f"per core): {this['floor_ms']:.2f} ms, at most {this['tokens_per_s_ceiling']:.1f} steps/s\n",
            _render_by_length(report["decode_by_length"]),
            table(
                [dict(r, GB=r["saved_bytes"] / GB) for r in report["savings"]]
                or [{"what": "none: bf16 weights, every tensor where the layout places it"}],
                [("what", "savings counted per rank"), ("instead_of", "instead of"), ("GB", "GB saved", "{:.2f}")],
            )
            + "\n",
            table(
                report["largest_shapes"],
                [("batch", "batch"), ("context", "longest context that fits"), ("tokens", "batch × context")],
            )
            + _largest_line(report["largest_shapes"])
            + f"\n(the weights, reserves, KV cache and graph estimate per core at each batch, contexts in steps of "
            f"{SHAPE_STEP}; the graph estimate prefills the whole context at once, an upper bound)\n",
            table(host_rows, [("what", "host memory, loading and serving"), ("GiB", "GiB", "{:.2f}")]) + "\n",
            render_compile_host(report["compile_host"], report["instance"]) + "\n",
            table(
                report["host_per_step"],
                [("what", "host <-> device per decode step"), ("direction", ""), ("bytes", "bytes"), ("when", "when")],
            ),
            "",
        ]
    lines += [render_speculation(report["speculation"])] if report.get("speculation") else []
    lines.append(f"{'FITS' if report['fits'] else 'DOES NOT FIT'}: {report['reason']}")
    return "\n".join(lines)


def _host_rows(report: dict) -> list[dict]:
    """The plan's host-memory table: the process, the graphs, the streamed load, its peak and margin."""
    host = report["host"]
    rows = [
        {"what": "process: Python, torch, torch-neuronx, NxD, server (stated)", "GiB": host["process_bytes"] / GiB},
        {"what": "compiled graphs, model.pt (stated)", "GiB": host["graphs_bytes"] / GiB},
        {
            "what": f"streamed load: {host['load_copies']} × one rank's {host['largest_load_group']}",
            "GiB": host["load_copies"] * host["largest_load_group_bytes"] / GiB,
        },
        {"what": "peak", "GiB": host["peak_bytes"] / GiB},
    ]
    if "memory_bytes" in host:
        rows.append({"what": f"margin of {report['instance']}'s host memory", "GiB": host["margin_bytes"] / GiB})
    rows.append(
        {
            "what": "(every rank's whole shard in memory at once, for comparison)",
            "GiB": host["whole_shards_peak_bytes"] / GiB,
        }
    )
    return rows


def render_speculation(spec_plan: dict) -> str:
    """The verify step's reads and its floor per token kept."""
    head = (
        f"speculative decoding ({spec_plan['method']}, k = {spec_plan['num_speculative_tokens']}): a verify step "
        f"reads {spec_plan['verify_bytes'] / GB:.3f} GB per rank ({spec_plan['verify_graph']})"
        + (f", the draft {spec_plan['draft_bytes'] / GB:.3f} GB" if spec_plan["draft_bytes"] else "")
        + f"; {spec_plan['step_floor_ms']:.2f} ms per step at the HBM floor\n"
    )
    return (
        head
        + table(
            spec_plan["per_kept"],
            [
                ("kept", "tokens kept per step"),
                ("floor_ms_per_token", "HBM floor ms/token", "{:.2f}"),
                ("tokens_per_s_ceiling", "tokens/s ceiling", "{:.1f}"),
            ],
        )
        + "\n"
    )

"""Whole-model decode on a GPU: tokens/s of HF's model with a static cache and CUDA graphs, the full
experts against the reader, at batch 1, 4 and 8.

Models, with random bf16 weights of the real shapes, built on the meta device and materialised on the
GPU by HF's own initialisation there (no host copy, a few seconds):

- `gemma4-26b-a4b`: transformers' Gemma4ForCausalLM at the config of ports/gemma4-26b-a4b.toml
  (30 layers, 128 experts top-8 beside a dense MLP, sliding + global attention; ~52 GB);
- `qwen3-30b-a3b`: transformers' Qwen3MoeForCausalLM at Qwen3-30B-A3B's published config (48 layers, 128
  experts top-8 of I 768, no dense MLP, hidden 2048, 32 query / 4 KV heads of 128, vocab 151936; ~61 GB;
  the values third-party copies of its config.json agree on, not read from the checkpoint here). HF's own
  Qwen3 model, not Gemma-4 at Qwen3's sizes: its experts module has the layout and interface the reader
  plugs into (`mlp.experts`: gate_up_proj [E, 2I, H], down_proj [E, H, I]), so the reader runs unchanged.

Experts, per model and batch:

- `batched_mm`, `grouped_mm`: transformers' implementations of the full experts (both timed; the faster
  is the baseline the reader is compared with);
- `reader-17.8`, `reader-12.8`: `channel_reader` on the Triton kernels (`--reader-variants`: the default
  kernels, and variants of bench/gpu_reader.py beside them at 17.8 %: `reader-17.8 NAME`), its sidecar
  prepped on the GPU from the model's own
  expert weights (`reader/prep.py` prep_layer, layer by layer) within `--prep-seconds`. Layers past that
  budget reuse the prepped layers' sidecars in turn — the same shapes and reads, so the same time; only
  the sketch then comes from another layer's weights — and the JSON says how many were prepped.

Decode: a `--prompt`-token random prompt per row is prefilled (eagerly, the reader's prefill being the
full experts), a few decode steps warm up (Triton compiles, cuBLAS chooses), then `--steps` greedy steps
(each step's argmax fed to the next) are captured in one CUDA graph on transformers' StaticCache, whose
positions are tensors updated in place (its sliding layers keep their fill as a Python int, which
advances during the capture, so each captured step has its own position's mask). The graph is replayed
`--replays` times from the same start (the cache lengths and the first token reset in place first):
tokens/s = batch × steps / replay time, the median. transformers' own route to graphs — generate() on
CUDA with a static cache compiles the forward (generation/utils.py `_valid_auto_compile_criteria`;
CompileConfig: torch.compile mode "reduce-overhead") — would send the reader's Triton launches and its
decode pre-hook through dynamo, and graph-break into several graphs where it cannot trace; a manual
capture of the eager forward needs neither and is the same for every experts implementation.

Check, at batch 1 before any timing: one decode step on the same prompt, the first MoE layer's experts
output of each configuration against a reference — the full experts against `dense_masked`
(fixed-shape, all experts), the reader against its own PyTorch reference kernel on the same sidecar —
within 2e-2 of its largest entry (bf16, as bench/gpu_reader.py's check). The first layer's experts see
the same input whichever implementation runs; the logits do not (random weights through every layer in
bf16 amplify rounding: `first_step`), so their difference is recorded (`logits_rel_err`), not checked.

    python -m bench.gpu_decode                         # GPU: $OUT/gpu_decode.json and .md
    python -m bench.gpu_decode --models gemma4-26b-a4b qwen3-30b-a3b
    python -m bench.gpu_decode --dry-run               # CPU, tiny port and Qwen3, interpreter: build/dry-run/
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Gemma4ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, StaticCache

from bench.gpu_env import default_json, header, interpret_on_cpu, machine
from bench.harness import command, write_results
from neuron_moe import experts as _registered  # noqa: F401  (registers channel_reader, dense_masked)
from neuron_moe import spec
from neuron_moe.errors import UserError
from neuron_moe.experts.channel_reader import ReaderState, reader_forward
from neuron_moe.port import load_port
from neuron_moe.reader.accounting import solve_k
from neuron_moe.spec import Reader
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.hadamard import padded, random_signs
from neuron_moe.reader.prep import SCAN, down_rows, model_expert_weights, prep_layer
from neuron_moe.reader.sidecar import BLOCK, LayerSidecar
from neuron_moe.report import table

BUDGETS = (17.8, 12.8)
PAPER_BATCH1 = (1.15, 1.36)  # the source paper's full-model decode gain at batch 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: the tiny port's geometry and a tiny Qwen3, eager steps, the Triton interpreter",
    )
    p.add_argument("--models", nargs="+", metavar="NAME", help="default: gemma4-26b-a4b (qwen3-30b-a3b: add it)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8], metavar="B")
    p.add_argument("--steps", type=int, default=16, help="decode steps per CUDA graph (default 16)")
    p.add_argument("--replays", type=int, default=3, help="timed replays of the graph (default 3; the median)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row (default 32)")
    p.add_argument("--recovery-rank", type=int, help="the reader's recovery rank (default 32; a dry run: per model)")
    p.add_argument(
        "--prep-seconds",
        type=float,
        default=60.0,
        help="GPU time for sidecar prep per model (default 60): layers past it reuse prepped sidecars",
    )
    p.add_argument(
        "--reader-variants",
        nargs="+",
        default=["bisect"],
        metavar="NAME",
        help="the reader's kernels: 'bisect' (the default eight launches), a select variant, 'fused', "
        "'relaxed' or a 'persistent ...' variant (bench/gpu_reader.py's names); the first at both "
        "budgets, the others at the first budget only",
    )
    p.add_argument(
        "--fastest-from",
        metavar="JSON",
        help="a bench/gpu_reader.py result: its fastest checked reader "
        "variant at batch 1 (first geometry, first budget), where faster than the default, joins "
        "--reader-variants",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="S",
        help="seconds this run may take: a model after the "
        "first is skipped (and said so) where the first's time, scaled by parameters, would not fit",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="default: $OUT/gpu_decode.json, else bench/results/ (a dry run: build/dry-run/); the markdown goes "
        "beside it (.md)",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.batches, args.steps, args.replays, args.prompt = [1, 2], 1, 1, 4
    return args


args: argparse.Namespace  # the command line's, set by main()
DEVICE = "cuda"  # "cpu" in a dry run (main)
BF16 = torch.bfloat16
TOLERANCE = 2e-2  # of the first MoE layer's largest output entry: the check's bound (bf16, as bench/gpu_reader.py)


def qwen3_config(**sizes) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's config (see the module docstring), `sizes` changed (the dry run's tiny one); its
    top-k also under Gemma-4's name, `top_k_experts`, which the package's `Geometry.from_config` reads."""
    fields = dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=True,
        mlp_only_layers=[],
        bos_token_id=151643,
        eos_token_id=151645,
    )
    fields |= sizes
    return Qwen3MoeConfig(**fields, top_k_experts=fields["num_experts_per_tok"])


def models() -> dict:
    """name -> (model class, config, recovery rank)."""
    gemma = load_port("gemma4-26b-a4b").config
    tiny = load_port("tiny-gemma4-moe").config
    return {
        "gemma4-26b-a4b": (Gemma4ForCausalLM, gemma, 32),
        "qwen3-30b-a3b": (Qwen3MoeForCausalLM, qwen3_config(), 32),
        # the dry run's: the tiny port's geometry (rank 0: a rank-32 map alone is 12.5 % of its reads), and a
        # tiny Qwen3 wide enough for a rank-2 map at 12.8 %
        "tiny-gemma4": (Gemma4ForCausalLM, tiny, 0),
        "tiny-qwen3": (
            Qwen3MoeForCausalLM,
            qwen3_config(
                vocab_size=512,
                hidden_size=256,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                num_experts=16,
                num_experts_per_tok=4,
                moe_intermediate_size=64,
                max_position_embeddings=256,
                bos_token_id=1,
                eos_token_id=2,
            ),
            2,
        ),
    }


def build(cls, config):
    """The model with random weights of the real shapes on DEVICE: built on the meta device, cast to bf16
    there, materialised empty on DEVICE and filled by HF's own initialisation (rotary tables included).
    Each decoder layer's routed experts are `layer.experts`, where the package's reader code finds them
    (Gemma-4's place; a Qwen3 layer keeps them in `layer.mlp.experts`, and gets the same module under
    Gemma-4's name too: no copy, its forward unchanged)."""
    with torch.device("meta"):  # a copy of the config: set_*_implementation mutates it
        model = cls(copy.deepcopy(config)).to(BF16)
    model.to_empty(device=DEVICE)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()  # on DEVICE: no host copy of the weights
    model.set_attn_implementation("sdpa")
    for layer in model.model.layers:
        if not hasattr(layer, "experts"):
            layer.experts = layer.mlp.experts
    return model.eval()


@torch.no_grad()
def prep_sidecars(model, rank: int, seconds: float) -> tuple[list[LayerSidecar], list[float]]:
    """Sidecars of the first layers, prepped on DEVICE from the model's own expert weights (HF layout),
    until `seconds` have passed (at least one); and each layer's prep time."""
    signs = random_signs(padded(model.config.hidden_size, BLOCK), seed=0).to(DEVICE)
    sidecars, times = [], []
    start = time.perf_counter()
    for gate_up, down in model_expert_weights(model):
        t0 = time.perf_counter()
        tensors = prep_layer(gate_up, down, signs, rank)
        sync()
        sidecars.append(LayerSidecar.from_tensors(tensors, signs))
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > seconds:
            break
    return sidecars, times


def mark_decode(state):
    """A pre-hook on a decoder layer: the reader runs where the layer's input is one new token per row."""

    def hook(layer, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        state.decode = hidden.shape[1] == 1

    return hook


@torch.no_grad()
def attach(model, sidecars: list[LayerSidecar], rank: int) -> None:
    """The reader on every MoE layer (`channel_reader.attach_reader`'s steps, from in-memory sidecars):
    down_proj rearranged in place into rows, layer i given sidecar i mod len."""
    for i, layer in enumerate(model.model.layers):
        experts = layer.experts
        experts.down_proj = torch.nn.Parameter(down_rows(experts.down_proj.data).contiguous().mT, requires_grad=False)
        experts.reader = ReaderState(sidecars[i % len(sidecars)], 0, SCAN, rank)
        experts.reader.hook = layer.register_forward_pre_hook(mark_decode(experts.reader), with_kwargs=True)
    spec.set_experts(model, spec.CHANNEL_READER)


def set_reader(model, k: int, run) -> None:
    for layer in model.model.layers:
        layer.experts.reader.k, layer.experts.reader.run = k, run


def triton_variant(name: str):
    """The Triton reader's forward for a variant name (`reader/triton/variants.py`; "bisect": the default)."""
    from neuron_moe.reader.triton import variants

    return variants.reader_forward(name)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompt(model, batch: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(batch)
    return torch.randint(3, model.config.vocab_size, (batch, args.prompt), generator=gen, device=DEVICE)


def new_cache(model) -> StaticCache:
    """Room for the prompt, the warm-up, the capture and every replay even where steps run eagerly (a
    failed capture; the dry run): there, the sliding layers' Python-side fill advances on every run."""
    return StaticCache(config=model.config, max_cache_len=args.prompt + (args.replays + 4) * args.steps + 8)


def step(model, cache, ids):
    """One greedy decode step: the next token [B, 1] and its fp32 logits [B, V]."""
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].float()
    return logits.argmax(-1, keepdim=True), logits


@torch.no_grad()
def first_step(model, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step after the prompt (prefill eager), for the checks: the first MoE layer's experts
    output and the logits. The first layer's experts see the same input whatever implementation runs
    (nothing upstream differs), so their outputs compare at the kernels' own tolerance; the logits of
    random weights, through every layer in bf16, can differ far more between two correct
    implementations (on the tiny port's geometry: 0.28 of the largest logit in bf16, 1e-6 in fp32, the
    first layer's experts 3e-3 in bf16), so they are recorded, not checked. The step's token is the
    prompt's first, not the prefill's argmax."""
    seen = []
    hook = model.model.layers[0].experts.register_forward_hook(lambda module, args, out: seen.append(out.float()))
    try:
        cache = new_cache(model)
        ids = prompt(model, batch)
        step(model, cache, ids)
        logits = step(model, cache, ids[:, :1])[1]
    finally:
        hook.remove()
    return seen[-1], logits


def rel_err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@torch.no_grad()
def decode_rate(model, batch: int) -> dict:
    """tokens/s of `args.steps` greedy steps captured in one CUDA graph (eager steps in a dry run, or where
    the capture fails: then said so), the median of `args.replays` replays."""
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cache = new_cache(model)
    ids, _ = step(model, cache, prompt(model, batch))
    warm = 2
    if DEVICE == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warm):
                ids, _ = step(model, cache, ids)
        torch.cuda.current_stream().wait_stream(side)
    lengths = [(layer.cumulative_length, layer.cumulative_length.clone()) for layer in cache.layers]
    first = ids.clone()
    graph, why = None, None
    if DEVICE == "cuda":
        graph, static_in = torch.cuda.CUDAGraph(), first.clone()
        try:
            with torch.cuda.graph(graph):
                t = static_in
                for _ in range(args.steps):
                    t, _ = step(model, cache, t)
        except Exception as e:  # not capturable: eager steps instead, and say so
            graph, why = None, f"{type(e).__name__}: {e}"[:500]
            torch.cuda.synchronize()

    def run():
        for length, start in lengths:
            length.copy_(start)
        if graph is not None:
            static_in.copy_(first)
            graph.replay()
        else:
            t = first
            for _ in range(args.steps):
                t, _ = step(model, cache, t)

    if DEVICE == "cuda":
        run()  # a first replay outside the timing
    times = []
    for _ in range(args.replays):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    out = {
        "cuda_graph": graph is not None,
        "ms_per_step": 1e3 * seconds / args.steps,
        "tokens_per_s": batch * args.steps / seconds,
    }
    if why:
        out["graph_error"] = why
    if DEVICE == "cuda":
        out["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30  # weights, cache, graph pool
    # free the graph's pool and the cache before empty_cache; rebound, not deleted: run() closes over them
    graph = cache = lengths = None
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def measure(report, dest, name, model, experts: str, check: tuple[float, bool], k=None, **first) -> None:
    """Time every batch for one configuration, appending rows (a failure recorded, the rest measured);
    the check (and `first`) on the first batch's row."""
    for batch in args.batches:
        row = {"model": name, "batch": batch, "experts": experts, "k": k}
        if batch == args.batches[0]:
            row.update(check_rel_err=check[0], check_ok=check[1], **first)
        try:
            row.update(decode_rate(model, batch))
            print(
                f"{name} B={batch} {experts}: {row['tokens_per_s']:.1f} tok/s ({row['ms_per_step']:.2f} ms/step, "
                f"graph {row['cuda_graph']})",
                flush=True,
            )
        except Exception as e:  # one GPU run: record the failure, measure the rest
            row.update(error=f"{type(e).__name__}: {e}"[-2000:], check_ok=False)
            print(f"{name} B={batch} {experts}: FAILED {row['error']}", flush=True)
        report["rows"].append(row)
        write_report(report, dest)


def speedups(rows) -> None:
    """× the faster full-experts implementation of the same model and batch."""
    for r in rows:
        full = [
            x["tokens_per_s"]
            for x in rows
            if x["model"] == r["model"]
            and x["batch"] == r["batch"]
            and x["experts"] in ("batched_mm", "grouped_mm")
            and "tokens_per_s" in x
        ]
        if full and "tokens_per_s" in r:
            r["speedup_vs_best_full"] = r["tokens_per_s"] / max(full)


COLUMNS = [
    ("model", "model"),
    ("batch", "B"),
    ("experts", "experts"),
    ("k", "k"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("ms_per_step", "ms/step", "{:.2f}"),
    ("speedup_vs_best_full", "× best full", "{:.2f}"),
    ("paper_batch1", "paper B=1"),
    ("cuda_graph", "graph"),
    ("check_rel_err", "check err", "{:.1e}"),
    ("check_ok", "check"),
]


def write_report(report, dest: str) -> None:
    """The speed-ups and the paper's figure filled in, then the JSON and its page (`page`) beside it."""
    speedups(report["rows"])
    for r in report["rows"]:
        if r["batch"] == 1 and r["experts"].startswith("reader"):
            r["paper_batch1"] = "{}–{}×".format(*PAPER_BATCH1)
    write_results(report, dest, page)


def page(report) -> str:
    """The markdown page: the machine, the command, the models, the table (the steps, prompt, replays and
    reader kernels as this run's command line set them)."""
    lines = [
        f"# bench/gpu_decode.py — {report['machine']['device']}",
        "",
        header(report["machine"]),
        "",
        f"Command: `{report['command']}`. {args.steps} greedy steps per CUDA graph after a {args.prompt}-token "
        f"prompt, the median of {args.replays} replays; reader kernels: {', '.join(args.reader_variants)}. "
        "The source paper's "
        f"full-model decode gain at batch 1 is {PAPER_BATCH1[0]}–{PAPER_BATCH1[1]}× (column 'paper B=1').",
        "",
    ]
    for name, why in report["skipped"].items():
        lines.append(f"- {name}: not run ({why})")
    for name, info in report["models"].items():
        lines.append(
            f"- {name}: {info['parameters'] / 1e9:.2f} B parameters ({info['weights_GB']:.1f} GB bf16), built "
            f"in {info['build_s']:.1f} s; sidecar prepped on the device for {info.get('prepped_layers', 0)} of "
            f"{info['layers']} layers in {info.get('prep_s', 0):.1f} s (the rest reuse them in turn)"
        )
    lines += ["", table(report["rows"], COLUMNS, markdown=True), ""]
    return "\n".join(lines)


def run_model(report, dest, name) -> None:
    cls, config, rank = models()[name]
    rank = rank if args.recovery_rank is None else args.recovery_rank
    start = t0 = time.perf_counter()
    model = build(cls, config)
    sync()
    params = sum(p.numel() for p in model.parameters())
    info = report["models"][name] = {
        "parameters": params,
        "weights_GB": 2 * params / 1e9,
        "layers": len(model.model.layers),
        "build_s": time.perf_counter() - t0,
        "rank": rank,
    }
    print(f"{name}: {params / 1e9:.2f} B parameters built on {DEVICE} in {info['build_s']:.1f} s", flush=True)
    spec.set_experts(model, spec.DENSE_MASKED)
    reference = first_step(model)
    full = {}
    for impl in ("batched_mm", "grouped_mm"):
        spec.set_experts(model, impl)
        full[impl] = first_step(model)
        err = rel_err(full[impl][0], reference[0])
        measure(
            report,
            dest,
            name,
            model,
            impl,
            (err, err <= TOLERANCE),
            logits_rel_err=rel_err(full[impl][1], reference[1]),
        )
    t0 = time.perf_counter()
    sidecars, times = prep_sidecars(model, rank, args.prep_seconds)
    info.update(prepped_layers=len(sidecars), prep_s=time.perf_counter() - t0, prep_s_per_layer=times)
    print(f"{name}: sidecar of {len(sidecars)}/{info['layers']} layers prepped in {info['prep_s']:.1f} s", flush=True)
    attach(model, sidecars, rank)
    first, *others = args.reader_variants
    for budget, variant in [(b, first) for b in BUDGETS] + [(BUDGETS[0], v) for v in others]:
        k = solve_k(Geometry.from_config(model.config), Reader(recovery_rank=rank).resolved(), budget)
        set_reader(model, k, reader_forward("reference"))
        want = first_step(model)
        set_reader(model, k, triton_variant(variant))
        got = first_step(model)
        err = rel_err(got[0], want[0])
        # vs_full: the first layer's reader output against the full experts' (not a check: a sign that it ran,
        # and sparsely)
        measure(
            report,
            dest,
            name,
            model,
            f"reader-{budget}" + ("" if variant == "bisect" else f" {variant}"),
            (err, err <= TOLERANCE),
            k=k,
            logits_rel_err=rel_err(got[1], want[1]),
            vs_full=rel_err(got[0], full["batched_mm"][0]),
        )
    info["seconds"] = time.perf_counter() - start
    del model, sidecars
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def fastest_variant(path: Path) -> str | None:
    """The fastest reader variant at batch 1 in a bench/gpu_reader.py JSON (its variant geometry, the first
    budget), checked against the reference, where it beat the default in that run; else None."""
    report = json.loads(Path(path).read_text())
    rows = [
        r
        for r in report["rows"]
        if r["geometry"] == report.get("variant_geometry")
        and r["tokens"] == 1
        and r["impl"].startswith(f"reader-{BUDGETS[0]}")
        and r.get("check_ok")
        and r.get("us")
    ]
    default = next((r["us"] for r in rows if r["impl"] == f"reader-{BUDGETS[0]}"), None)
    best = min(rows, key=lambda r: r["us"], default=None)
    if best is None or default is None or best["us"] >= default:
        return None
    return best["impl"].partition(" ")[2]


def skip_reason(report, name: str, left: float | None) -> str | None:
    """Why `name` is not run with `left` seconds of the budget left (None: run it): the first model's time,
    scaled by parameters, would not fit."""
    if not report["models"] or left is None:
        return None
    done = next(iter(report["models"].values()))
    cls, config, _ = models()[name]
    with torch.device("meta"):
        params = sum(p.numel() for p in cls(copy.deepcopy(config)).parameters())
    need = done["seconds"] * params / done["parameters"]
    return f"~{need:.0f} s needed at the first model's rate, {left:.0f} s of the budget left" if need > left else None


def main(argv: list[str] | None = None) -> int:
    global args, DEVICE
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        interpret_on_cpu("bench.gpu_decode", argv)
        DEVICE = "cpu"
    names = args.models or (["tiny-gemma4", "tiny-qwen3"] if args.dry_run else ["gemma4-26b-a4b"])
    unknown = sorted(set(names) - set(models()))
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)}; known: {', '.join(models())}")
    dest = args.json or str(default_json("gpu_decode", args.dry_run))
    report = {
        "machine": machine(args.dry_run),
        "command": command("bench.gpu_decode", argv),
        "steps": args.steps,
        "replays": args.replays,
        "prompt": args.prompt,
        "reader_variants": args.reader_variants,
        "paper_batch1": list(PAPER_BATCH1),
        "models": {},
        "skipped": {},
        "rows": [],
    }
    if args.fastest_from:
        fastest = fastest_variant(args.fastest_from)
        print(f"fastest checked reader variant at batch 1 in {args.fastest_from}: {fastest or 'the default'}")
        if fastest and fastest not in args.reader_variants:
            args.reader_variants.append(fastest)
    for variant in args.reader_variants:
        try:
            triton_variant(variant)  # an unknown name stops the run here, not after a model is built
        except UserError as e:
            raise SystemExit(f"--reader-variants: {e}") from None
    began = time.perf_counter()
    for name in names:
        why = skip_reason(report, name, args.time_budget and args.time_budget - (time.perf_counter() - began))
        if why:
            report["skipped"][name] = why
            print(f"{name}: skipped ({why})", flush=True)
            continue
        run_model(report, dest, name)
    write_report(report, dest)
    print(
        f"\nJSON: {dest} (markdown beside it); the paper's full-model gain at batch 1: "
        f"{PAPER_BATCH1[0]}–{PAPER_BATCH1[1]}×\n"
    )
    print(table(report["rows"], COLUMNS))
    return 0 if all(r.get("check_ok", True) and "tokens_per_s" in r for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())

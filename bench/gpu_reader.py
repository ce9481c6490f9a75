"""The reader's MoE block on a GPU against dense top-k baselines: time, bytes, bandwidth.

One MoE layer's routed experts (router output given), for the Gemma-4 26B-A4B and
Qwen3-30B-A3B layer geometries, batch 1, 4 and 8 decode tokens, bf16 weights:

- `hf-batched_mm`, `hf-grouped_mm`: transformers' own experts implementations;
- `triton-dense`: a fused-MoE-style Triton GEMV (gate/up rows with the activation fused, then
  down rows) — the reader's own exact kernels with every channel selected;
- `reader-17.8`, `reader-12.8`: the reader's Triton kernels at those read budgets;
- `reader-17.8 <variant>`: the same with one of the select kernel's variants
  (`triton/forward.py` SELECT_VARIANTS: radix search, one-scan placement), whose select stage
  is also timed alone, or `fused` (`forward(fuse=True)`: six launches instead of eight); a
  table of the variants side by side is printed before the main one. Each variant is first
  checked, at the real shapes and in a process of its own (`--preflight`), to pick exactly
  what the default does (fused: to match the reference): one that faulted on the device
  would end the run.

Weights are random of the real shapes (nothing here depends on their values), several
layers of them, cycled with fresh routings so that consecutive calls do not find the previous
call's experts in L2. The reader's sidecar is random too, in the exact layout of
`reader/prep.py` (prep of a real layer takes minutes on a CPU; the kernels' work depends
only on the shapes). Every implementation is first checked against its reference in fp32 on
the same inputs (dense: the einsum MoE; reader: `reader.reference.forward`). Each is then
timed over a CUDA graph of `--iters` calls (one capture per layer and routing buffer; launch
overhead is what a served decode step pays with graphs), against the copy bandwidth of the
same card (a device-to-device copy of 1 GiB). Bytes read are the accounting's, per token ×
tokens (`reader/accounting.py`): a lower bound on what the kernels move.

    python bench/gpu_reader.py                  # on the GPU: JSON to $OUT/gpu_reader.json
    python bench/gpu_reader.py --dry-run        # CPU, tiny shapes, Triton interpreter (CI runs it)
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (hidden, experts, top_k, intermediate, activation, recovery rank)
GEOMETRIES = {
    "gemma4-26b-a4b": (2816, 128, 8, 704, "gelu_pytorch_tanh", 32),
    "qwen3-30b-a3b": (2048, 128, 8, 768, "silu", 32),
}
DRY_GEOMETRIES = {  # a hidden size that is not a multiple of 128; low rank so that 12.8 % fits such small layers
    "tiny-gemma-like": (320, 8, 2, 160, "gelu_pytorch_tanh", 4),
    "tiny-qwen-like": (256, 8, 2, 160, "silu", 2),
}
BUDGETS = (17.8, 12.8)
FUSED = "fused"  # the reader's variant beside the select kernel's: forward(fuse=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter, each "
                                                              "implementation run once (its check)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8], metavar="T")
    p.add_argument("--layers", type=int, default=4, help="layers of weights cycled through (default 4)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per implementation (default 50)")
    p.add_argument("--json", metavar="FILE", help="default: $OUT/gpu_reader.json, else bench/results/")
    p.add_argument("--preflight", action="store_true", help="only check the reader's variants against its "
                                                                "default (run by the script in a process of its own)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.layers, args.batches = 1, [1, 2]
    return args


args = parse_args()
if args.dry_run:  # before triton is first imported (transformers imports it)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig  # noqa: E402
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts  # noqa: E402

from neuron_moe.reader import reference  # noqa: E402
from neuron_moe.reader.accounting import Geometry, Layout, full_bytes, reads, solve_k  # noqa: E402
from neuron_moe.reader.hadamard import random_signs  # noqa: E402
from neuron_moe.reader.prep import LayerSidecar  # noqa: E402
from neuron_moe.reader.prep import Layout as SidecarLayout  # noqa: E402
from neuron_moe.reader.triton import forward as triton_reader  # noqa: E402
from neuron_moe.report import table, write_json  # noqa: E402

DEVICE = "cpu" if args.dry_run else "cuda"
BF16 = torch.bfloat16


class Layer:
    """One layer: bf16 weights in HF's layout (for HF's experts) and the reader's [E, I, H] rows, and a
    random sidecar in the exact layout `prep.py` writes."""

    def __init__(self, hidden, experts, inter, act, rank, gen):
        def randn(*shape, scale=0.02):
            return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(BF16)

        gate_up, down = randn(experts, 2 * inter, hidden), randn(experts, hidden, inter)
        self.hf = {}
        for impl in ("batched_mm", "grouped_mm"):
            config = Gemma4TextConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                      hidden_activation=act)
            config._experts_implementation = impl
            with torch.device("meta"):  # no host copy of the weights: the parameters are set below
                module = Gemma4TextExperts(config)
            module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)  # one copy for both modules
            module.down_proj = torch.nn.Parameter(down, requires_grad=False)
            self.hf[impl] = module
        self.gate_up, self.down = gate_up, down
        self.down_rows = down.mT.contiguous()  # attach_reader's layout (in the model: in place, one copy)
        self.act_fn = ACT2FN[act]
        spec = SidecarLayout(hidden, experts, inter, rank).layer_tensors()
        basis = torch.linalg.qr(torch.randn(hidden, rank, generator=gen, device=DEVICE))[0]
        sidecar = {
            "codes": torch.randint(0, 243, spec["codes"][1], generator=gen, device=DEVICE, dtype=torch.uint8),
            "scales": (torch.rand(spec["scales"][1], generator=gen, device=DEVICE) * 0.02).to(BF16),
            "down_norms": down.float().norm(dim=1).to(BF16),
            "basis": basis.to(BF16),
            "coeffs": torch.einsum("hr,ehi->eir", basis, down.float()).to(BF16),
        }
        signs = random_signs(spec["codes"][1][1] * 128, seed=0).to(DEVICE)
        self.sidecar = LayerSidecar.from_tensors(sidecar, signs)


def routing(tokens, experts, top_k, gen):
    index = torch.rand(tokens, experts, generator=gen, device=DEVICE).argsort(dim=-1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen, device=DEVICE), dim=-1)
    return index, weights


def dense_reference(layer, x, index, weights):
    """Σ_e w_e D_e(φ(G_e x) ⊙ U_e x) in fp32 from the bf16 weights."""
    gate, up = torch.einsum("th,tkrh->tkr", x.float(), layer.gate_up[index].float()).chunk(2, dim=-1)
    h = layer.act_fn(gate) * up * weights.float()[..., None]
    return torch.einsum("tki,tkhi->th", h, layer.down[index].float())


def implementations(geo, rank, variants):
    """name -> (forward(layer, x, index, weights), bytes per token, k or None for the dense ones);
    `variants`: the reader's variants beside the default to run at the first budget (names in
    SELECT_VARIANTS, or FUSED)."""
    full = full_bytes(geo)
    out = {
        "hf-batched_mm": (lambda L, x, i, w: L.hf["batched_mm"](x, i, w), full, None),
        "hf-grouped_mm": (lambda L, x, i, w: L.hf["grouped_mm"](x, i, w), full, None),
        "triton-dense": (lambda L, x, i, w: triton_reader.dense_forward(x, i, w, L.gate_up, L.down_rows,
                                                                       act_fn=L.act_fn), full, None),
    }
    for budget in BUDGETS:
        k = solve_k(geo, Layout(rank=rank), budget)
        for variant in ["bisect", *variants] if budget == BUDGETS[0] else ["bisect"]:  # the default first

            def run(L, x, i, w, k=k, variant=variant):
                how = {"fuse": True} if variant == FUSED else {"select_variant": variant}
                return triton_reader.forward(x, i, w, L.gate_up, L.down_rows, L.sidecar, k=k, scan=80, rank=rank,
                                             act_fn=L.act_fn, **how)

            name = f"reader-{budget}" + ("" if variant == "bisect" else f" {variant}")
            out[name] = (run, sum(reads(geo, Layout(rank=rank), k).values()), k)
    return out


def check(fn, layer, x, index, weights, k, rank):
    """Max error relative to the largest output entry, against the fp32 reference of the same inputs;
    and the seconds the call took (the time a dry run reports: it runs each implementation once)."""
    start = time.perf_counter()
    got = fn(layer, x, index, weights).float()
    seconds = time.perf_counter() - start
    if k is None:
        want = dense_reference(layer, x, index, weights)
    else:
        want = reference.forward(x, index, weights, layer.gate_up, layer.down_rows, layer.sidecar, k=k, scan=80,
                                 rank=rank, act_fn=layer.act_fn).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    return err, err <= 2e-2, seconds  # bf16 inputs and outputs: a few bf16 ulps of the largest entry


def cycled(layers, inputs, iters):
    """`iters` calls' arguments, cycling through layers and routings."""
    return [(layers[i % len(layers)], *inputs[i % len(inputs)]) for i in range(iters)]


def timed(fn, calls):
    """Seconds per call of fn(*c) over `calls`, in one CUDA graph on a GPU."""
    iters = len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:3]:
            fn(*c)  # warm-up: Triton compiles, cuBLAS picks its kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for c in calls:
                fn(*c)
        replay, graphed = graph.replay, True
    except Exception:  # not capturable (a host sync inside): time the eager calls instead, and say so
        graph = None

        def replay():
            for c in calls:
                fn(*c)
        graphed = False
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, graphed


def same_picks(a, b) -> bool:
    """Two `triton_reader.select` results are the same: expert, channel, weight and q tensors equal."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


def reader_stages(layers, inputs, k, rank, iters, variants):
    """Microseconds per call of each stage of the Triton reader (`triton/forward.py`), each timed on
    its own over the same calls with the previous stages' outputs precomputed: where the time goes.
    A stage that reduces into a zeroed buffer is timed with its own zeroing (one more launch).
    And, for each select variant's stage, whether it picks exactly what the default does (the same
    expert, channel, weight and recovery weight tensors from the same estimates)."""
    def prepared(layer, x, index, weights):
        sc = layer.sidecar
        act = triton_reader.activation(layer.act_fn)
        coords, values = triton_reader.rotate_scan(x, sc.signs, 80)
        est = triton_reader.screen(values, coords, index, sc.codes, sc.scales)
        expert, channel, weight, q = triton_reader.select(est, index, weights, sc.down_norms, k, act)
        gu = triton_reader.exact(x, expert, channel, layer.gate_up)
        z = triton_reader.recover(q, index, sc.coeffs, rank)
        return dict(L=layer, sc=sc, act=act, x=x, coords=coords, values=values, est=est, index=index,
                    weights=weights, expert=expert, channel=channel, weight=weight, q=q, gu=gu, z=z)

    stages = {
        "rotate+scan": lambda d: triton_reader.rotate_scan(d["x"], d["sc"].signs, 80),
        "screen": lambda d: triton_reader.screen(d["values"], d["coords"], d["index"], d["sc"].codes, d["sc"].scales),
        "select": lambda d: triton_reader.select(d["est"], d["index"], d["weights"], d["sc"].down_norms, k, d["act"]),
        "exact gate/up": lambda d: triton_reader.exact(d["x"], d["expert"], d["channel"], d["L"].gate_up),
        "recover": lambda d: triton_reader.recover(d["q"], d["index"], d["sc"].coeffs, rank),
        "down (+U)": lambda d: triton_reader.down(d["gu"], d["weight"], d["expert"], d["channel"], d["L"].down_rows,
                                                  d["act"], d["sc"].basis, d["z"], rank),
        "zeroing alone": lambda d: torch.zeros(d["x"].shape[0], d["est"].shape[1] * d["est"].shape[2],
                                               device=d["x"].device),
        # forward(fuse=True)'s two stages that differ (the same workspace size as the zeroing above)
        "rotate+scan, zeroing": lambda d: triton_reader.rotate_scan(
            d["x"], d["sc"].signs, 80, zero=torch.empty(d["est"].numel(), device=d["x"].device)),
        "exact+recover, one launch": lambda d: triton_reader.exact_recover(
            d["x"], d["expert"], d["channel"], d["L"].gate_up, d["q"], d["index"], d["sc"].coeffs, rank,
            torch.zeros_like(d["gu"]), torch.zeros_like(d["z"])),
    }
    # variants beside the defaults (`triton/forward.py` chose its defaults from such rows)
    for warps in (2, 4):
        stages[f"screen, {warps} warps"] = lambda d, w=warps: triton_reader.screen(
            d["values"], d["coords"], d["index"], d["sc"].codes, d["sc"].scales, warps=w)
    for warps in (4, 16):
        stages[f"select, {warps} warps"] = lambda d, w=warps: triton_reader.select(
            d["est"], d["index"], d["weights"], d["sc"].down_norms, k, d["act"], warps=w)
    for variant in (v for v in variants if v != FUSED):
        stages[f"select, {variant}"] = lambda d, kw=triton_reader.SELECT_VARIANTS[variant]: triton_reader.select(
            d["est"], d["index"], d["weights"], d["sc"].down_norms, k, d["act"], **kw)
    stages["down (+U), split 16"] = lambda d: triton_reader.down(
        d["gu"], d["weight"], d["expert"], d["channel"], d["L"].down_rows, d["act"], d["sc"].basis, d["z"], rank,
        split=16)
    distinct = 1 if DEVICE == "cpu" else min(iters, len(layers) * len(inputs))  # a dry run only runs each once
    calls = [(prepared(*c),) for c in cycled(layers, inputs, distinct)]
    calls = [calls[i % len(calls)] for i in range(iters)]
    want = stages["select"](*calls[0])
    out, same = {}, {}
    for name, fn in stages.items():
        variant = name.startswith("select, ") and "warps" not in name
        try:  # one device call per session: a stage that fails leaves the others' times
            if variant:
                same[name] = False  # until shown
                same[name] = same_picks(want, fn(*calls[0]))
            elif DEVICE == "cpu":
                fn(*calls[0])  # a dry run runs each stage once
            out[name] = None if DEVICE == "cpu" else timed(fn, calls)[0] * 1e6
        except Exception as e:
            print(f"stage {name}: FAILED {type(e).__name__}: {e}", flush=True)
            out[name] = None
    return out, same


def variants_side_by_side(rows, stage_rows):
    """The reader's variants side by side per geometry and batch: the select stage alone (the
    default's for `fused`) and the whole reader at the first budget; checked: the reader against the
    reference, and a select variant's picks against the default's (`reader_stages`)."""
    out = []
    for r in rows:
        head, _, variant = r["impl"].partition(" ")
        if head != f"reader-{BUDGETS[0]}":
            continue
        variant = variant or "bisect"
        stage = "select" if variant in ("bisect", FUSED) else f"select, {variant}"
        timed_alone = [s for s in stage_rows if s["geometry"] == r["geometry"] and s["tokens"] == r["tokens"]
                       and s["stage"] == stage]
        same = timed_alone[0].get("same_picks", True) if timed_alone else None  # the default: itself
        out.append({"geometry": r["geometry"], "tokens": r["tokens"], "variant": variant,
                    "select_us": timed_alone[0]["us"] if timed_alone else None, "reader_us": r.get("us"),
                    "speedup_vs_best_dense": r.get("speedup_vs_best_dense"), "same_picks": same,
                    "check_ok": r["check_ok"] and same is True})
    return out


def preflight() -> int:
    """`--preflight`: each select variant on this device at the real shapes and batches, against the
    default's picks (expert, channel, weight, q all equal), on random estimates and on coarse ones
    with equal norms (many tied scores); then the fused reader against the reference (`check`), last,
    so that a fault there cannot hide the select variants' results. Prints `same <variant>` for each
    that agrees."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    geometries = (DRY_GEOMETRIES if args.dry_run else GEOMETRIES).values()
    inputs = []
    for hidden, experts, top_k, inter, act, rank in geometries:
        k = solve_k(Geometry(hidden, experts, top_k, inter), Layout(rank=rank), BUDGETS[0])
        act = triton_reader.activation(ACT2FN[act])
        for tokens in args.batches:
            index, weights = routing(tokens, experts, top_k, gen)
            est = torch.randn(tokens, top_k, 2 * inter, generator=gen, device=DEVICE)
            norms = torch.rand(experts, inter, generator=gen, device=DEVICE).to(BF16)
            inputs.append((est, index, weights, norms, k, act))
            inputs.append((est.mul(2).round(), index, weights, torch.ones_like(norms), k, act))
    want = [triton_reader.select(*i) for i in inputs]
    for variant, keywords in triton_reader.SELECT_VARIANTS.items():
        if not keywords:
            continue  # the default
        got = [triton_reader.select(*i, **keywords) for i in inputs]
        if all(same_picks(w, g) for w, g in zip(want, got)):
            print(f"same {variant}", flush=True)
    fused_ok = True
    for hidden, experts, top_k, inter, act, rank in geometries:
        geo = Geometry(hidden, experts, top_k, inter)
        fn, _, k = implementations(geo, rank, [FUSED])[f"reader-{BUDGETS[0]} {FUSED}"]
        layer = Layer(hidden, experts, inter, act, rank, gen)
        for tokens in args.batches:
            x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(BF16)
            fused_ok &= check(fn, layer, x, *routing(tokens, experts, top_k, gen), k, rank)[1]
        del layer
    if fused_ok:
        print(f"same {FUSED}", flush=True)
    return 0


def checked_variants() -> tuple[list[str], dict[str, bool]]:
    """The reader's variants (beside the default) that agree with it on this device, checked in a
    process of their own: one that faults there would otherwise end this run."""
    names = [v for v in triton_reader.SELECT_VARIANTS if v != "bisect"] + [FUSED]
    argv = [sys.executable, __file__, "--preflight", "--batches", *map(str, args.batches)]
    try:
        done = subprocess.run(argv + (["--dry-run"] if args.dry_run else []), capture_output=True, text=True,
                              timeout=300)
        same = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("same ")}
    except subprocess.TimeoutExpired:
        done, same = None, set()
    ok = {v: v in same for v in names}
    if not all(ok.values()):
        why = "timed out" if done is None else f"exit {done.returncode}: {done.stderr[-1500:]}"
        print(f"preflight: {', '.join(v for v in names if not ok[v])} not shown to agree with the default, "
              f"so not run ({why})", flush=True)
    return [v for v in names if ok[v]], ok


def copy_bandwidth():
    """Device-to-device copy of 1 GiB: bytes read + written per second (what the card's HBM sustains)."""
    if DEVICE == "cpu":
        src = torch.empty(1 << 24, dtype=torch.uint8)
        dst = torch.empty_like(src)
        start = time.perf_counter()
        dst.copy_(src)
        return 2 * src.numel() / (time.perf_counter() - start)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    del src, dst
    return 2 * 10 * (1 << 30) / (start.elapsed_time(end) / 1e3)


def machine():
    info = {"torch": torch.__version__, "triton": triton.__version__, "dry_run": args.dry_run,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    info["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)"
    return info


def main() -> int:
    if args.preflight:
        return preflight()
    variants, preflight_ok = checked_variants()
    torch.manual_seed(0)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    copy_bw = copy_bandwidth()
    rows, stage_rows = [], []
    for name, (hidden, experts, top_k, inter, act, rank) in (DRY_GEOMETRIES if args.dry_run else GEOMETRIES).items():
        geo = Geometry(hidden, experts, top_k, inter)
        layers = [Layer(hidden, experts, inter, act, rank, gen) for _ in range(args.layers)]
        impls = implementations(geo, rank, variants)
        for tokens in args.batches:
            inputs = []
            for _ in range(min(args.iters, 8)):
                index, weights = routing(tokens, experts, top_k, gen)
                x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(BF16)
                inputs.append((x, index, weights))
            for impl, (fn, per_token, k) in impls.items():
                try:
                    err, ok, seconds = check(fn, layers[0], *inputs[0], k, rank)
                    graphed = False
                    if not args.dry_run:
                        seconds, graphed = timed(fn, cycled(layers, inputs, args.iters))
                except Exception as e:  # one device call per session: record the failure, measure the rest
                    why = f"{type(e).__name__}: {e}" + (f"\ncaused by {e.__cause__!r}" if e.__cause__ else "")
                    print(f"{name} T={tokens} {impl}: FAILED {why}", flush=True)
                    rows.append({"geometry": name, "tokens": tokens, "impl": impl, "k": k or geo.channels,
                                 "check_ok": False, "error": why[-2000:]})
                    continue
                nbytes = per_token * tokens
                rows.append({"geometry": name, "tokens": tokens, "impl": impl, "k": k or geo.channels,
                             "check_rel_err": err, "check_ok": ok, "us": seconds * 1e6, "cuda_graph": graphed,
                             "bytes": nbytes, "read_percent": 100 * per_token / full_bytes(geo),
                             "GBps": nbytes / seconds / 1e9, "of_copy_bw": nbytes / seconds / copy_bw})
                print(f"{name} T={tokens} {impl}: {seconds * 1e6:.1f} us, check {'ok' if ok else 'FAILED'} "
                      f"({err:.1e})", flush=True)
            k = impls[f"reader-{BUDGETS[0]}"][2]
            try:
                times, same = reader_stages(layers, inputs, k, rank, args.iters, variants)
                for stage, us in times.items():
                    stage_rows.append({"geometry": name, "tokens": tokens, "budget": BUDGETS[0], "stage": stage,
                                       "us": us, **({"same_picks": same[stage]} if stage in same else {})})
            except Exception as e:
                print(f"{name} T={tokens} reader stages: FAILED {type(e).__name__}: {e}", flush=True)
        del layers
        for r in rows:
            if r["geometry"] == name:
                dense = [x["us"] for x in rows if x["geometry"] == name and x["tokens"] == r["tokens"]
                         and not x["impl"].startswith("reader") and "us" in x]
                if dense and "us" in r:
                    r["speedup_vs_best_dense"] = min(dense) / r["us"]
    variant_rows = variants_side_by_side(rows, stage_rows)
    report = {"machine": machine(), "copy_GBps": copy_bw / 1e9, "iters": args.iters, "layers": args.layers,
              "rows": rows, "reader_stages": stage_rows, "variants": variant_rows,
              "preflight": preflight_ok}
    dest = args.json or (str(Path(os.environ["OUT"]) / "gpu_reader.json") if os.environ.get("OUT")
                         else str(Path(__file__).parent / "results" / "gpu_reader.json"))
    write_json(report, dest)
    print("\nreader stages, each timed alone (µs per call):")
    print(table(stage_rows, [("geometry", "geometry"), ("tokens", "T"), ("budget", "budget"), ("stage", "stage"),
                             ("us", "µs", "{:.1f}")]))
    print(f"\nreader variants at {BUDGETS[0]} % reads (µs per call; select alone, and the whole reader):")
    print(table(variant_rows, [("geometry", "geometry"), ("tokens", "T"), ("variant", "variant"),
                               ("select_us", "select µs", "{:.1f}"), ("reader_us", "reader µs", "{:.1f}"),
                               ("speedup_vs_best_dense", "× best dense", "{:.2f}"), ("same_picks", "same picks"),
                               ("check_ok", "check")]))
    print(f"\n{report['machine']['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s; JSON: {dest}\n")
    print(table(rows, [("geometry", "geometry"), ("tokens", "T"), ("impl", "implementation"), ("k", "k"),
                       ("read_percent", "reads", "{:.1f}%"), ("us", "µs/layer", "{:.1f}"),
                       ("speedup_vs_best_dense", "× best dense", "{:.2f}"), ("GBps", "GB/s", "{:.0f}"),
                       ("of_copy_bw", "of copy", "{:.0%}"), ("cuda_graph", "graph"),
                       ("check_ok", "check")]))
    return 0 if all(r["check_ok"] for r in rows + variant_rows) and all(preflight_ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""SEQ_MATCH: greedy tokens of a backend against the CPU reference (HF eager, fp32).

A backend (`spec.Backend`, named in BACKENDS) becomes a generator: anything that turns (input_ids,
attention_mask, max_new_tokens) into a `Generation`. The backends are every experts implementation
that validate runs inside HF's model (`spec.Experts.backend`), the port's static graphs through
torch.export, and those graphs at TP on gloo.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..errors import UserError
from ..greedy import Generation, greedy, left_pad
from ..model import build_model, reader_model
from ..parallel.tp_generator import tp_generator
from ..port import DTYPES
from ..report import table
from ..spec import (
    EAGER,
    EAGER_GRAPHS,
    EXPERTS,
    EXPORTED,
    INT4_QUANTIZATION,
    INT8_QUANTIZATION,
    NAIVE,
    NO_QUANTIZATION,
    SIDECAR,
    SPMD,
    Backend,
    Placement,
    Reader,
)
from ..static.generator import traced_backend
from ..tokenizer import answer_text

# In the trained default model's domain (neuron_moe/tasks.py): a fact, two tasks, and text.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Q: Reverse: red fox owl sun\nA:",
    "Q: cat=41 owl=17 sun=93 key=25. What is owl?\nA:",
    "Q: Add 7 to 223, 15 times.\nA:",
)

Generator = Callable[[torch.Tensor, torch.Tensor, int], Generation]

BACKENDS: dict[str, Backend] = {
    # the experts implementations in HF's model, eager included (the reference against itself: a check
    # of the harness); the reader (channel_reader) on decode steps, full experts on prefill
    **{e.backend: Backend(e.backend, EAGER_GRAPHS, e) for e in EXPERTS.values() if e.backend},
    "traced": Backend("traced", EXPORTED),  # the port's static graphs through torch.export (neuron_moe/static)
    # those graphs at TP 8 on gloo (neuron_moe/parallel); the seed bug lives in the expert layout's
    # router scatter (the channel layout has none); int8 experts with per-channel scales, int4 experts
    # group-wise (compare them with --backend int8 / int4: HF's model with the same numbers on one rank)
    "tp8": Backend("tp8", EXPORTED, placement=Placement()),
    "tp8-naive-scatter": Backend("tp8-naive-scatter", EXPORTED, placement=Placement(scatter=NAIVE)),
    "tp8-int8": Backend("tp8-int8", EXPORTED, placement=Placement(), quantization=INT8_QUANTIZATION),
    "tp8-int4": Backend("tp8-int4", EXPORTED, placement=Placement(), quantization=INT4_QUANTIZATION),
}
TP_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.placement is not None)
_READER_FLAGS = {
    "sidecar": "sidecar",
    "budget": "budget",
    "rank": "rank",
    "kernel": "reader_kernel",
    "weights": "reader_weights",
}  # Reader field -> its option


def _reads(backend: Backend) -> bool:
    """The one-rank reader: an experts implementation that needs a sidecar."""
    return backend.experts is not None and backend.experts.needs == SIDECAR


def _reads_at_tp(backend: Backend) -> bool:
    """Where the reader runs in the TP decode graph: the float experts, scattered by the SPMDRank."""
    return (
        backend.placement is not None and backend.placement.scatter == SPMD and backend.quantization == NO_QUANTIZATION
    )


def backend(
    name: str,
    *,
    sidecar=None,
    budget=None,
    rank=None,
    reader_kernel=None,
    reader_weights=None,
    expert_layout=None,
    tp=None,
    tp_layers=None,
    dtype: str | None = None,
) -> Backend:
    """BACKENDS[name] with the options given (not None); options it does not take are refused. The
    reader takes them all but expert_layout; tp8 runs the reader in its decode graph with sidecar,
    budget and rank; the TP backends take expert_layout, tp (the degree) and tp_layers (the
    parallel-layer library: cpu or nxd). `dtype`: a port dtype name (None: the port's)."""
    base = BACKENDS[name]
    reader = Reader(sidecar=sidecar, budget=budget, rank=rank, kernel=reader_kernel, weights=reader_weights)
    given = [flag for field, flag in _READER_FLAGS.items() if getattr(reader, field) is not None]
    tp_reader = _reads_at_tp(base) and bool(given)  # the reader in the TP decode graph
    if tp_reader and ({"reader_kernel", "reader_weights"} & set(given) or sidecar is None):
        raise UserError(
            "--backend tp8 runs the reader with --sidecar DIR (from `neuron-moe prep-reader --tp T`) and "
            "--budget; its kernels are the PyTorch reference over the bf16 experts "
            "(no --reader-kernel, no --reader-weights)"
        )
    if given and not _reads(base) and not tp_reader:
        raise UserError(
            f"--{'/--'.join(given).replace('_', '-')} apply to --backend reader only "
            f"(--sidecar, --budget and --rank also to tp8)"
        )
    placement = {"expert_layout": expert_layout, "tp": tp, "layers": tp_layers}
    for field, value in placement.items():
        if value is not None and base.placement is None:
            flag = "--tp-layers" if field == "layers" else f"--{field.replace('_', '-')}"
            raise UserError(f"{flag} applies to the TP backends ({', '.join(TP_BACKENDS)}) only")
    if base.placement is not None:
        base = dataclasses.replace(
            base, placement=dataclasses.replace(base.placement, **{k: v for k, v in placement.items() if v is not None})
        )
    return dataclasses.replace(base, reader=reader if _reads(base) or tp_reader else None, dtype=dtype)


def backend_options(backend: Backend) -> dict:
    """The options `backend` was given (its report's backend_options)."""
    reader, placement = backend.reader or Reader(), backend.placement or Placement()
    options = {flag: getattr(reader, field) for field, flag in _READER_FLAGS.items()}
    options.update(expert_layout=placement.expert_layout, tp=placement.tp, layers=placement.layers)
    return {k: v for k, v in options.items() if v is not None}


def generator(port, backend: Backend, checkpoint=None) -> Generator:
    """What `backend` generates with on `port`'s model: its TP ranks, its exported graphs, or HF's
    model with its experts (the reader attached to it when it reads)."""
    dtype = DTYPES[backend.dtype] if backend.dtype else None
    if backend.placement is not None:
        return tp_generator(port, backend, dtype, checkpoint)
    if backend.graphs == EXPORTED:
        return traced_backend(port, dtype, checkpoint)
    if _reads(backend):
        r = backend.reader or Reader()
        model = reader_model(
            port,
            dtype,
            checkpoint,
            sidecar=r.sidecar,
            budget=r.budget,
            rank=r.rank,
            reader_kernel=r.kernel or "reference",
            reader_weights=r.weights or "bf16",
        )
    else:
        model = build_model(port, backend.experts, dtype, checkpoint)
    return lambda ids, mask, n: greedy(model, ids, mask, n)


def compare(reference: Generation, backend: Generation, prompts: list[str]) -> list[dict]:
    """One row per prompt: SEQ_MATCH, first divergent position, max |Δlogit| at step 0, and the
    lowest logit cosine over the steps where both had produced the same prefix. A NaN or inf among
    the compared logits fails the prompt whatever the tokens (argmax of NaNs picks a token too)."""
    rows = []
    for i, prompt in enumerate(prompts):
        ref_t, got_t = reference.tokens[i], backend.tokens[i]
        diverged = (ref_t != got_t).nonzero()
        first = int(diverged[0]) if len(diverged) else None
        comparable = (first if first is not None else len(ref_t) - 1) + 1  # up to and incl. the first miss
        ref_l, got_l = reference.logits[i, :comparable], backend.logits[i, :comparable].to(torch.float32)
        cosine = torch.nn.functional.cosine_similarity(ref_l, got_l, dim=-1)
        finite = bool(torch.isfinite(ref_l).all() and torch.isfinite(got_l).all())
        rows.append(
            {
                "prompt": prompt,
                "seq_match": first is None and finite,
                "finite_logits": finite,
                "first_divergence": first,
                "max_abs_dlogit_step0": float((ref_l[0] - got_l[0]).abs().max()),
                "min_cosine": float(cosine.min()),
                "new_tokens": len(ref_t),
            }
        )
    return rows


def run_validation(port, tokenizer, backend: Backend, max_new_tokens: int, prompts: list[str], checkpoint=None) -> dict:
    ids, mask = left_pad([tokenizer.encode(p) for p in prompts], tokenizer.pad_token_id)
    context = port.config.max_position_embeddings
    if ids.shape[1] + max_new_tokens > context:
        raise UserError(
            f"the longest prompt ({ids.shape[1]} tokens) plus --max-new-tokens {max_new_tokens} exceeds "
            f"the model's context of {context} tokens"
        )
    # the backend first: a backend that refuses the input does so before the reference has run
    generate = generator(port, backend, checkpoint)
    got = generate(ids, mask, max_new_tokens)
    reference = build_model(port, EAGER, torch.float32, checkpoint)
    ref_gen = greedy(reference, ids, mask, max_new_tokens)
    del reference
    rows = compare(ref_gen, got, prompts)
    for row, ref_t, got_t in zip(rows, ref_gen.tokens, got.tokens):  # SEQ_MATCH compares every token;
        row["reference_text"] = answer_text(tokenizer, ref_t.tolist())  # the texts end at the first EOS
        row["backend_text"] = answer_text(tokenizer, got_t.tolist())
    return {
        "model": port.name,
        "reference": "hf-eager float32 (CPU)",
        "backend": backend.name,
        "backend_dtype": str(DTYPES[backend.dtype] if backend.dtype else port.dtype).removeprefix("torch."),
        "backend_options": {k: str(v) for k, v in backend_options(backend).items()},
        **getattr(generate, "details", {}),  # the TP backends: layers, layer_library, tp, expert_layout
        "max_new_tokens": max_new_tokens,
        "all_match": all(r["seq_match"] for r in rows),
        "prompts": rows,
    }


def render_validation(report: dict) -> str:
    shown = [dict(r, prompt=repr(r["prompt"])) for r in report["prompts"]]  # newlines visible, one row each
    lines = [
        f"SEQ_MATCH  {report['model']}: {report['backend']} ({report['backend_dtype']}) "
        f"vs {report['reference']}, {report['max_new_tokens']} new tokens"
    ]
    if "layer_library" in report:
        lines.append(f"TP {report['tp']}, expert layout {report['expert_layout']}, layers: {report['layer_library']}")
    lines += [
        "",
        table(
            shown,
            [
                ("prompt", "prompt"),
                ("seq_match", "SEQ_MATCH"),
                ("first_divergence", "first diff"),
                ("max_abs_dlogit_step0", "max|Δlogit| step 0"),
                ("min_cosine", "min cosine", "{:.7f}"),
            ],
        ),
    ]
    lines += [
        f"\n{row['prompt']!r}: NaN or inf among the logits (a failed comparison)"
        for row in report["prompts"]
        if not row["finite_logits"]
    ]
    lines.append("\nreference (greedy) continuations, up to the first EOS:")
    lines += [f"  {row['prompt']!r} -> {row['reference_text']!r}" for row in report["prompts"]]
    lines.append(
        f"\n{'PASS' if report['all_match'] else 'FAIL'}: "
        f"{sum(r['seq_match'] for r in report['prompts'])}/{len(report['prompts'])} prompts match"
    )
    return "\n".join(lines)

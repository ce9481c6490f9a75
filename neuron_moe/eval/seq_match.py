"""SEQ_MATCH: greedy tokens of a backend against the CPU reference (HF eager, fp32).

A backend is anything that turns (input_ids, attention_mask, max_new_tokens) into a
`Generation`. Today the backends are the experts implementations run inside HF's model;
later ones (traced graphs, Neuron artifacts) plug into BACKENDS with the same contract.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import UserError
from ..greedy import Generation, greedy, left_pad
from ..model import build_model, reader_model
from ..parallel.tp_generator import BACKENDS as TP_BACKENDS
from ..report import table
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


def _hf_backend(experts: str):
    def make(port, dtype, checkpoint) -> Generator:
        model = build_model(port, experts, dtype, checkpoint)
        return lambda ids, mask, n: greedy(model, ids, mask, n)

    return make


def _reader_backend(port, dtype, checkpoint, **options) -> Generator:
    model = reader_model(port, dtype, checkpoint, **options)  # options: sidecar, budget, rank, reader_kernel
    return lambda ids, mask, n: greedy(model, ids, mask, n)


BACKENDS: dict[str, Callable[..., Generator]] = {
    "dense_masked": _hf_backend("dense_masked"),
    "int8": _hf_backend("int8"),
    "eager": _hf_backend("eager"),  # the reference against itself: a check of the harness
    "traced": traced_backend,  # the port's static graphs through torch.export (neuron_moe/static)
    "reader": _reader_backend,  # the sparse-channel reader on decode steps, full experts on prefill
    **TP_BACKENDS,  # tp8, tp8-naive-scatter, tp8-int8: those graphs at TP 8 on gloo (neuron_moe/parallel)
}


def backend_options(backend: str, *, sidecar=None, budget=None, rank=None, reader_kernel=None, reader_weights=None,
                    expert_layout=None, tp=None, tp_layers=None) -> dict:
    """The options given (not None) that BACKENDS[backend] is built with; options it does not take are
    refused. The reader takes them all but expert_layout; tp8 runs the reader in its decode graph with
    sidecar, budget and rank; the TP backends take expert_layout, tp (the degree) and tp_layers (the
    parallel-layer library: cpu or nxd)."""
    given = {"sidecar": sidecar, "budget": budget, "rank": rank, "reader_kernel": reader_kernel,
             "reader_weights": reader_weights}
    options = {k: v for k, v in given.items() if v is not None}
    tp_reader = backend == "tp8" and bool(options)  # the reader in the TP 8 decode graph
    if tp_reader and ({"reader_kernel", "reader_weights"} & options.keys() or sidecar is None):
        raise UserError("--backend tp8 runs the reader with --sidecar DIR (from `neuron-moe prep-reader --tp T`) and "
                        "--budget; its kernels are the PyTorch reference over the bf16 experts "
                        "(no --reader-kernel, no --reader-weights)")
    if options and backend != "reader" and not tp_reader:
        raise UserError(f"--{'/--'.join(options).replace('_', '-')} apply to --backend reader only "
                        f"(--sidecar, --budget and --rank also to tp8)")
    tp_options = {"expert_layout": expert_layout, "tp": tp, "layers": tp_layers}
    for name, value in tp_options.items():
        if value is not None:
            if backend not in TP_BACKENDS:
                flag = "--tp-layers" if name == "layers" else f"--{name.replace('_', '-')}"
                raise UserError(f"{flag} applies to the TP backends ({', '.join(TP_BACKENDS)}) only")
            options[name] = value
    return options


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
        rows.append({
            "prompt": prompt,
            "seq_match": first is None and finite,
            "finite_logits": finite,
            "first_divergence": first,
            "max_abs_dlogit_step0": float((ref_l[0] - got_l[0]).abs().max()),
            "min_cosine": float(cosine.min()),
            "new_tokens": len(ref_t),
        })
    return rows


def run_validation(port, tokenizer, backend: str, max_new_tokens: int, prompts: list[str],
                   dtype: torch.dtype | None = None, checkpoint=None, backend_options: dict | None = None) -> dict:
    ids, mask = left_pad([tokenizer.encode(p) for p in prompts], tokenizer.pad_token_id)
    context = port.config.max_position_embeddings
    if ids.shape[1] + max_new_tokens > context:
        raise UserError(f"the longest prompt ({ids.shape[1]} tokens) plus --max-new-tokens {max_new_tokens} exceeds "
                        f"the model's context of {context} tokens")
    # the backend first: a backend that refuses the input does so before the reference has run
    generator = BACKENDS[backend](port, dtype, checkpoint, **(backend_options or {}))
    got = generator(ids, mask, max_new_tokens)
    reference = build_model(port, "eager", torch.float32, checkpoint)
    ref_gen = greedy(reference, ids, mask, max_new_tokens)
    del reference
    rows = compare(ref_gen, got, prompts)
    for row, ref_t, got_t in zip(rows, ref_gen.tokens, got.tokens):  # SEQ_MATCH compares every token;
        row["reference_text"] = answer_text(tokenizer, ref_t.tolist())  # the texts end at the first EOS
        row["backend_text"] = answer_text(tokenizer, got_t.tolist())
    return {
        "model": port.name,
        "reference": "hf-eager float32 (CPU)",
        "backend": backend,
        "backend_dtype": str(dtype or port.dtype).removeprefix("torch."),
        "backend_options": {k: str(v) for k, v in (backend_options or {}).items()},
        **getattr(generator, "details", {}),  # the TP backends: layers, layer_library, tp, expert_layout
        "max_new_tokens": max_new_tokens,
        "all_match": all(r["seq_match"] for r in rows),
        "prompts": rows,
    }


def render_validation(report: dict) -> str:
    shown = [dict(r, prompt=repr(r["prompt"])) for r in report["prompts"]]  # newlines visible, one row each
    lines = [f"SEQ_MATCH  {report['model']}: {report['backend']} ({report['backend_dtype']}) "
             f"vs {report['reference']}, {report['max_new_tokens']} new tokens"]
    if "layer_library" in report:
        lines.append(f"TP {report['tp']}, expert layout {report['expert_layout']}, layers: {report['layer_library']}")
    lines += ["",
             table(shown, [
                 ("prompt", "prompt"), ("seq_match", "SEQ_MATCH"), ("first_divergence", "first diff"),
                 ("max_abs_dlogit_step0", "max|Δlogit| step 0"), ("min_cosine", "min cosine", "{:.7f}"),
             ])]
    lines += [f"\n{row['prompt']!r}: NaN or inf among the logits (a failed comparison)"
              for row in report["prompts"] if not row["finite_logits"]]
    lines.append("\nreference (greedy) continuations, up to the first EOS:")
    lines += [f"  {row['prompt']!r} -> {row['reference_text']!r}" for row in report["prompts"]]
    lines.append(f"\n{'PASS' if report['all_match'] else 'FAIL'}: "
                 f"{sum(r['seq_match'] for r in report['prompts'])}/{len(report['prompts'])} prompts match")
    return "\n".join(lines)

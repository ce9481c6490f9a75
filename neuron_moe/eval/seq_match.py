"""SEQ_MATCH: greedy tokens of a backend against the CPU reference (HF eager, fp32).

A backend (`spec.Backend`, named in BACKENDS: spec.VALIDATE_BACKENDS) becomes a generator: anything
that turns (input_ids, attention_mask, max_new_tokens) into a `Generation`. The backends are every
experts implementation that validate runs inside HF's model (`spec.Experts.backend`), the port's
static graphs as modules as `serve --backend static` runs them (compiled by torch.compile unless
--no-compile), those graphs through torch.export, and at TP on gloo.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from .. import environment
from ..errors import UserError
from ..greedy import Generation, greedy, left_pad
from ..model import build_model, reader_model
from ..parallel.tp_generator import tp_generator
from ..port import DTYPES, load_port
from ..report import table
from ..spec import (
    EAGER,
    EXPORTED,
    MODULES,
    NO_QUANTIZATION,
    SIDECAR,
    SPMD,
    Backend,
    Placement,
    Reader,
    compile_cache,
    quantized,
    validate_backends,
)
from ..run_config import RunConfig
from ..hub import check_assistant
from ..static import inductor
from ..static.generator import static_backend, traced_backend
from ..tokenizer import answer_text, load_tokenizer

# In the trained default model's domain (neuron_moe/tasks.py): a fact, two tasks, and text.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Q: Reverse: red fox owl sun\nA:",
    "Q: cat=41 owl=17 sun=93 key=25. What is owl?\nA:",
    "Q: Add 7 to 223, 15 times.\nA:",
)

Generator = Callable[[torch.Tensor, torch.Tensor, int], Generation]

BACKENDS = validate_backends()  # spec.py: the experts implementations in HF's model, traced, tp
TP_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.placement is not None)


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
    reader: Reader = Reader(),
    quantization: str | None = None,
    quantized_layers=None,
    expert_layout: str | None = None,
    tp: int | None = None,
    tp_layers: str | None = None,
    dtype: str | None = None,
    compile: bool | None = None,
) -> Backend:
    """BACKENDS[name] with the options given (not None); options it does not take are refused. The
    reader takes every reader setting; tp runs the reader in its decode graph with sidecar, budget and
    recovery rank; the TP backends take expert_layout, tp (the degree) and tp_layers (the parallel-layer
    library: cpu or nxd). `quantization`: the weight format of the linears `quantized_layers` names
    (None: the routed experts; `spec.quantized`). `dtype`: the compute dtype, one of spec.DTYPE_NAMES
    (None: the port's). `compile`: the static graphs compiled by torch.compile (None: the default,
    compiled; False: --no-compile), static only."""
    base = quantized(BACKENDS[name], quantization, quantized_layers)
    if compile is not None and base.graphs != MODULES:
        raise UserError(f"--no-compile applies to --backend static (its graphs on CPU), not --backend {name}")
    given = list(reader.given())
    tp_reader = _reads_at_tp(base) and bool(given)  # the reader in the TP decode graph
    if tp_reader and ({"reader_kernel", "scan"} & set(given) or reader.sidecar is None):
        raise UserError(
            "--backend tp runs the reader with --sidecar DIR (from `neuron-moe prep-reader --tp T`) and "
            "--budget; its kernels are the PyTorch reference over the experts in the compute dtype "
            "(no --reader-kernel, no --quantization)"
        )
    if given and base.placement is not None and not tp_reader:
        raise UserError(
            f"--backend {name} runs the reader over the experts in the compute dtype, not --quantization {quantization}"
        )
    if given and not _reads(base) and not tp_reader:
        raise UserError(
            f"--{'/--'.join(given).replace('_', '-')} apply to --backend reader only "
            f"(--sidecar, --budget and --recovery-rank also to tp)"
        )
    if _reads(base):
        reader = dataclasses.replace(reader, quantization=quantization)
    placement = {"expert_layout": expert_layout, "tp": tp, "layers": tp_layers}
    for field, value in placement.items():
        if value is not None and base.placement is None:
            flag = "--tp-layers" if field == "layers" else f"--{field.replace('_', '-')}"
            raise UserError(f"{flag} applies to the TP backends ({', '.join(TP_BACKENDS)}) only")
    if base.placement is not None:
        base = dataclasses.replace(
            base, placement=dataclasses.replace(base.placement, **{k: v for k, v in placement.items() if v is not None})
        )
    return dataclasses.replace(
        base,
        reader=reader if _reads(base) or tp_reader else None,
        dtype=dtype,
        compile=base.graphs == MODULES and compile is not False,
    )


def backend_options(backend: Backend) -> dict:
    """The options `backend` was given (its report's backend_options)."""
    reader, placement = backend.reader or Reader(), backend.placement or Placement()
    options = dict(reader.given())
    if backend.quantization != NO_QUANTIZATION:
        options["quantization"] = backend.quantization
    if options.get("quantization", NO_QUANTIZATION) != NO_QUANTIZATION:  # the reader's int8: the experts
        options["quantized_layers"] = ",".join(backend.quantized_layers)
    options.update(expert_layout=placement.expert_layout, tp=placement.tp, layers=placement.layers)
    if backend.graphs == MODULES:
        options["compile"] = "inductor" if backend.compile else "none"
    return {k: v for k, v in options.items() if v is not None}


def generator(port, backend: Backend, checkpoint=None, speculative=None) -> Generator:
    """What `backend` generates with on `port`'s model: its TP ranks, its exported graphs, its graphs as
    modules (compiled or not: each compile says so on stderr; `speculative`, a
    `speculative.SpeculativeConfig`: speculating), or HF's model with its experts (the reader attached
    to it when it reads)."""
    if backend.placement is not None:
        return tp_generator(port, backend, checkpoint)
    dtype = DTYPES[backend.dtype] if backend.dtype else None
    if backend.graphs == EXPORTED:
        return traced_backend(port, dtype, checkpoint, **backend.formats)
    if backend.graphs == MODULES:
        return static_backend(
            port, dtype, checkpoint, backend.compile, progress=_to_stderr, speculative=speculative, **backend.formats
        )
    if _reads(backend):
        model = reader_model(port, dtype, checkpoint, backend.reader or Reader())
    else:
        model = build_model(port, backend.experts, dtype, checkpoint, **backend.formats)
    return lambda ids, mask, n: greedy(model, ids, mask, n)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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


def run_validation(
    port, tokenizer, backend: Backend, max_new_tokens: int, prompts: list[str], checkpoint=None, speculative=None
) -> dict:
    ids, mask = left_pad([tokenizer.encode(p) for p in prompts], tokenizer.pad_token_id)
    context = port.config.max_position_embeddings
    if ids.shape[1] + max_new_tokens > context:
        raise UserError(
            f"the longest prompt ({ids.shape[1]} tokens) plus --max-new-tokens {max_new_tokens} exceeds "
            f"the model's context of {context} tokens"
        )
    # the backend first: a backend that refuses the input does so before the reference has run
    generate = generator(port, backend, checkpoint, speculative)
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
        "speculative": None if speculative is None else dataclasses.asdict(speculative),
        "all_match": all(r["seq_match"] for r in rows),
        "prompts": rows,
    }


def render_validation(report: dict) -> str:
    shown = [dict(r, prompt=repr(r["prompt"])) for r in report["prompts"]]  # newlines visible, one row each
    quantization = report["backend_options"].get("quantization")
    layers = report["backend_options"].get("quantized_layers", "").replace(",", ", ")
    experts = f", {quantization} on {layers}" if quantization else ""
    experts += ", compiled by torch.compile" if report["backend_options"].get("compile") == "inductor" else ""
    speculative = report.get("speculative")
    experts += f", speculative {speculative['method']} k={speculative['num_speculative_tokens']}" if speculative else ""
    lines = [
        f"SEQ_MATCH  {report['model']}: {report['backend']} ({report['backend_dtype']}{experts}) "
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


# what a layer library or a reader kernel needs of this machine (environment.py's paths)
LAYERS_NEED = {"nxd": environment.VALIDATE_NXD}
KERNEL_NEEDS = {"nki": environment.READER_NKI, "triton": environment.READER_TRITON}


def validate(config: RunConfig, max_new_tokens: int, prompts: list[str]) -> dict:
    """`neuron-moe validate`: what the backend needs checked before anything loads (the compile
    cache and a C++ compiler where its graphs are compiled, the machine its layers or reader kernel
    need), then SEQ_MATCH of the backend against HF eager on DEFAULT_PROMPTS and `prompts`."""
    backend = config.backend
    if config.speculative is not None and backend.graphs != MODULES:
        raise UserError(f"--speculative-config runs in --backend static's graphs, not --backend {backend.name}")
    if config.compile_cache and not backend.compile:
        raise UserError(
            f"--compile-cache keeps the graphs torch.compile compiled; --backend {backend.name}"
            f"{' --no-compile' if config.compile is False else ''} compiles none"
        )
    if backend.compile:
        inductor.require_compiler()
        inductor.use_cache_dir(compile_cache(config.compile_cache))
    layers = backend.placement.layers if backend.placement else None
    kernel = backend.reader.kernel if backend.reader else None
    for need in (LAYERS_NEED.get(layers), KERNEL_NEEDS.get(kernel)):
        if need is not None:
            environment.require(need)
    port = load_port(config.model)
    if config.speculative is not None:  # its assistant found and fitting before anything loads
        check_assistant(config.speculative, port.config)
    tokenizer = load_tokenizer(port, config.checkpoint)
    prompts = [*DEFAULT_PROMPTS, *prompts]
    return run_validation(port, tokenizer, backend, max_new_tokens, prompts, config.checkpoint, config.speculative)

"""Every linear quantizable (`--quantized-layers`), in every weight format, through the TP rank modules
and trace-and-compile: each rank holds its shard of the format's tensors, and TP 2 is the format's
model on one rank (the same numbers: groups lie along each linear's input dim, int8's scales per
output channel) up to fp32 summation order."""

import pytest
import torch
from safetensors.torch import load_file

from neuron_moe import spec
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.neuron import artifact as na
from neuron_moe.neuron import compile as nc
from neuron_moe.parallel import cpu, layout
from neuron_moe.parallel.rank_job import RankJob
from neuron_moe.parallel.tp_generator import TPGenerator, generate_replicated
from neuron_moe.spec import LAYER_GROUPS, tp_backend
from neuron_moe.verify import verify

from conftest import preflight_violations, random_prompts

# a grouped format over the channel layout, and int8 (a scale per output channel, which a row layer's ranks
# hold whole: o_proj, the dense MLP's down) over the expert layout
CASES = [("q4_0", layout.CHANNEL), ("int8", layout.EXPERT)]


def _one_rank(port, prompts, quantization: str, expert_layout: str, layers=LAYER_GROUPS):
    """The rank module at TP 1 with `layers` in `quantization`: the numbers every degree holds."""
    backend = tp_backend(1, quantization=quantization, quantized_layers=layers, expert_layout=expert_layout)
    return greedy(RankJob.prepare(port, backend).rank_zero(cpu)[0], *prompts, 6)


@pytest.mark.slow
def test_tp2_every_format_on_every_linear_is_its_one_rank_model(tiny_port):
    prompts = left_pad(random_prompts(tiny_port.config.vocab_size, [19, 6], seed=55), 0)
    gens = {
        (q, e): TPGenerator(tiny_port, tp_backend(2, quantization=q, quantized_layers=LAYER_GROUPS, expert_layout=e))
        for q, e in CASES
    }
    out = generate_replicated({f"{q}-{e}": g for (q, e), g in gens.items()}, *prompts, 6)
    for (q, e), gen in gens.items():
        want, got = _one_rank(tiny_port, prompts, q, e), out[f"{q}-{e}"]
        assert torch.equal(got.tokens, want.tokens), (q, e)
        assert (got.logits - want.logits).abs().max() <= 1e-4 * want.logits.abs().max(), (q, e)
        assert preflight_violations(gen.programs) == [], (q, e)
        rank1 = gen.states[1]
        for name in ("model.model.layers.0.self_attn.o_proj.weight", "model.lm_head.weight"):
            assert rank1[name].dtype != torch.float32, (q, name)  # held in the format, not the compute dtype
    # teeth: the attention, MLP and lm_head in the format move the logits off the experts-only model
    q, e = CASES[0]
    experts_only = _one_rank(tiny_port, prompts, q, e, spec.DEFAULT_QUANTIZED_LAYERS)
    assert (out[f"{q}-{e}"].logits - experts_only.logits).abs().max() > 1e-3 * experts_only.logits.abs().max()


def _weight_bytes(out) -> dict[str, int]:
    """Bytes of every rank's weight file, by layer group (None: embeddings, norms, router, scalars)."""
    total: dict[str, int] = {}
    for rank in range(2):
        for name, t in load_file(out / na.RANK_WEIGHTS.format(rank=rank)).items():
            base = name.rpartition(".")[0] + ".weight"
            group = spec.layer_group(base)
            total[group] = total.get(group, 0) + t.numel() * t.element_size()
    return total


def test_dry_run_artifact_holds_every_linear_in_q4_0_and_verifies(tiny_port, tmp_path):
    """trace-and-compile --dry-run --tp 2 --quantization q4_0 --quantized-layers (all): the manifest
    records the layers, each rank holds every quantized linear as 4-bit values and an fp16 scale per
    32 inputs (18 bytes a block, as GGUF), the embeddings in the compute dtype; verify passes it."""
    out = tmp_path / "q4_0"
    build = nc.Build.at(tp=2, out=out, quantization="q4_0", quantized_layers=LAYER_GROUPS, dry_run=True, export=False)
    nc.trace_and_compile(tiny_port, build)
    manifest = na.read_manifest(out)
    assert (manifest["quantization"], manifest["quantized_layers"]) == ("q4_0", list(LAYER_GROUPS))
    shard = load_file(out / na.RANK_WEIGHTS.format(rank=1))
    prefix = "model.model.layers.1.self_attn.o_proj."
    assert (shard[prefix + "weight"].dtype, shard[prefix + "block_scale"].dtype) == (torch.uint8, torch.float16)
    assert shard["model.model.embed_tokens.weight"].dtype == torch.bfloat16
    bf16 = tmp_path / "bf16"
    nc.trace_and_compile(tiny_port, nc.Build.at(tp=2, out=bf16, dry_run=True, export=False))
    got, float_bytes = _weight_bytes(out), _weight_bytes(bf16)
    for group in LAYER_GROUPS:  # 18 bytes per 32 weights against 64 in bf16
        assert got[group] * 64 == float_bytes[group] * 18, group
    assert got[None] == float_bytes[None]
    report = verify(str(out), progress=False)  # raises naming the first file or field that is wrong
    assert (report["port"], report["files"]) == (tiny_port.name, len(manifest["files"]))

"""The reader inside HF's Gemma-4 model: `prep-reader`, `attach_reader`, decode vs prefill, and
`validate --backend reader`."""

import json

import pytest
import torch

import trained_like
from neuron_moe import cli
from neuron_moe.checkpoint import save_checkpoint
from neuron_moe.errors import UserError
from neuron_moe.experts.channel_reader import attach_reader
from neuron_moe.greedy import greedy, left_pad
from neuron_moe.model import build_model
from neuron_moe.reader.geometry import Geometry
from neuron_moe.reader.prep import write_sidecar
from neuron_moe.reader.sidecar import SidecarError

from conftest import port_text_elsewhere, random_prompts, reseeded, with_reader_table


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "tiny.safetensors"
    assert cli.main(["prep-reader", "--out", str(path)]) == 0
    return path


def test_prep_reader_cli_writes_a_checked_sidecar(sidecar, capsys):
    out = sidecar.with_name("again.safetensors")
    assert cli.main(["prep-reader", "--out", str(out), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["layers"], report["scan"], report["rank"]) == (4, 80, 32)
    assert out.read_bytes() == sidecar.read_bytes()  # deterministic: same weights, same seed, same bytes


def test_prep_from_a_checkpoint_streams_the_same_sidecar(tiny_port, sidecar, tmp_path, capsys):
    """From the multimodal layout on disk, layer by layer: byte-identical to the in-memory prep."""
    ckpt = save_checkpoint(build_model(tiny_port), tmp_path / "mm", multimodal=True)
    out = tmp_path / "from-ckpt.safetensors"
    assert cli.main(["prep-reader", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert out.read_bytes() == sidecar.read_bytes()
    (ckpt / "model.safetensors").write_bytes(b"not safetensors")
    assert cli.main(["prep-reader", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_validate_reader_at_full_budget_matches(sidecar, tmp_path):
    out = tmp_path / "v.json"
    args = [
        "validate",
        "--backend",
        "reader",
        "--budget",
        "100",
        "--sidecar",
        str(sidecar),
        "--max-new-tokens",
        "10",
        "--json",
        str(out),
    ]
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    assert report["all_match"] and report["backend_options"]["budget"] == "100.0"
    # at full budget the reader is the full MLP up to fp32 summation order: a few ulp of logits that
    # reach ~25 on the trained weights (measured 4-5e-6; ~1e-5 in the full suite)
    assert all(r["max_abs_dlogit_step0"] <= 3e-5 and r["min_cosine"] > 0.999999 for r in report["prompts"]), report


def test_decode_steps_run_the_reader_and_prefill_the_full_experts(tiny_port, tiny_eager, sidecar):
    ids, mask = left_pad(random_prompts(tiny_port.config.vocab_size, [12, 7], seed=4), pad_id=0)
    ref = greedy(tiny_eager, ids, mask, 6)
    model = build_model(tiny_port)
    k = attach_reader(model, sidecar, budget=60, rank=0)
    assert 0 < k < 4 * 64
    got = greedy(model, ids, mask, 6)
    # step 0's logits come from the prefill (every prompt token through the full experts): exact
    assert (got.logits[:, 0] - ref.logits[:, 0]).abs().max() <= 1e-5
    # later steps are decode steps through the reader at 60 %: close, not equal
    teacher = greedy(
        model, torch.cat([ids, ref.tokens[:, :1]], 1), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1), 1
    )
    step1 = teacher.logits[:, 0]
    assert (step1 - ref.logits[:, 1]).abs().max() <= 1e-5  # a fresh prefill of the same tokens: full experts again
    assert (got.logits[:, 1] - ref.logits[:, 1]).abs().max() > 1e-4
    cos = torch.nn.functional.cosine_similarity(got.logits[:, 1], ref.logits[:, 1], dim=-1)
    assert cos.min() > 0.9


def test_attach_keeps_one_copy_of_down_and_the_checkpoint_unchanged(tiny_port, sidecar, tmp_path):
    model = build_model(tiny_port)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attach_reader(model, sidecar, budget=100)
    experts = model.model.layers[2].experts
    assert experts.down_proj.shape == (16, 128, 64)  # HF's shape ...
    assert experts.down_proj.mT.is_contiguous()  # ... over [E, I, H] rows: one copy, reader layout
    state = model.state_dict()
    assert state.keys() == before.keys()  # the sidecar tensors are not weights
    assert all(torch.equal(state[k], before[k]) for k in before)
    assert experts.reader.codes.dtype == torch.uint8 and experts.reader.k == 4 * 64
    save_checkpoint(model, tmp_path / "ckpt")  # still saves in HF's layout
    attach_reader(model, sidecar, budget=50)  # re-attaching replaces, it does not stack hooks
    assert len(model.model.layers[2]._forward_pre_hooks) == 1


def test_a_sidecar_of_another_model_is_refused(tiny_port, sidecar):
    other = build_model(reseeded(tiny_port, 99))
    with pytest.raises(SidecarError, match="made from other expert weights"):
        attach_reader(other, sidecar, budget=50)


def test_a_sidecar_of_another_geometry_is_refused(tiny_port, tmp_path):
    ex = trained_like.experts(num_experts=16, inter=32, hidden=128)
    path = write_sidecar(
        tmp_path / "g.safetensors",
        [(ex.gate_up_proj, ex.down_proj)] * 4,
        Geometry(hidden=128, experts=16, intermediate=32),
        layers=4,
        progress=False,
    )
    with pytest.raises(UserError, match=r"sidecar geometry .* = \(128, 16, 32, 4\), this model's = \(128, 16, 64, 4\)"):
        attach_reader(build_model(tiny_port), path, budget=50)


def test_channel_reader_without_a_sidecar_says_what_to_do(tiny_port):
    model = build_model(tiny_port, "channel_reader")
    with pytest.raises(UserError, match="no sidecar attached"):
        model(torch.tensor([[2, 40, 41]]))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--backend", "dense_masked", "--budget", "50"], "--budget apply to --backend reader only"),
        (
            ["--backend", "reader", "--budget", "5", "--sidecar", "SIDECAR"],
            "budget 5.0% is below what the reader reads",
        ),
        (["--backend", "reader", "--sidecar", "SIDECAR"], "the reader needs a budget"),
        (["--backend", "reader", "--budget", "50", "--sidecar", "nowhere.safetensors"], "reader sidecar not found"),
    ],
)
def test_validate_reader_errors(sidecar, capsys, args, message):
    args = [str(sidecar) if a == "SIDECAR" else a for a in args]
    assert cli.main(["validate", *args]) == 2  # 32 tokens by default: fails before any generation
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_validate_reader_runs_with_its_defaults_on_the_default_model(capsys):
    """No --sidecar, no --rank: the sidecar is prepped from the model's weights and read at the port's recovery
    rank (0), which 17.8 % affords; at rank 32 the reader's fixed reads alone (18.49 %) are over the budget."""
    args = ["validate", "--backend", "reader", "--budget", "17.8", "--max-new-tokens", "8", "--json", "-"]
    assert cli.main(args) in (0, 1)  # it runs: SEQ_MATCH or not, a lossy reader's report
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert len(report["prompts"]) == 4 and report["backend_options"]["budget"] == "17.8"
    assert "no --sidecar: prepping the reader's sidecar (rank 0) from the model's weights" in captured.err
    assert cli.main(["validate", "--backend", "reader", "--budget", "17.8", "--recovery-rank", "32"]) == 2
    assert "budget 17.8% is below what the reader reads before any exact channel (18.49%" in capsys.readouterr().err


def test_a_budget_outside_0_100_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["validate", "--backend", "reader", "--budget", "150"])
    assert e.value.code == 2 and "argument --budget: must be in (0, 100], got 150" in capsys.readouterr().err


def test_port_reader_section_supplies_sidecar_and_budget(tiny_port, sidecar, tmp_path, capsys):
    port_file = tmp_path / "p.toml"
    text = port_text_elsewhere(tiny_port)
    port_file.write_text(with_reader_table(text, f'sidecar = "{sidecar}"\nbudget = 100'))
    assert (
        cli.main(["validate", "--model", str(port_file), "--backend", "reader", "--max-new-tokens", "3", "--json", "-"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["all_match"]
    # bad options fail at once, before the reference generates (no --max-new-tokens limit needed)
    for section, message in (
        ("budjet = 10", "[reader]: unknown field(s) ['budjet']"),
        ('budget = "lots"', "[reader]: field 'budget' must be int or float, got str 'lots'"),
    ):
        port_file.write_text(with_reader_table(text, f'sidecar = "{sidecar}"\n{section}'))
        assert cli.main(["validate", "--model", str(port_file), "--backend", "reader"]) == 2
        assert message in capsys.readouterr().err

"""neuron-moe preflight (neuron/preflight.py): each rule's seeded bad graph flagged with its own code and
nothing else, and a graph beside it that keeps the rule; saved programs refused through the CLI (exit 1);
what preflight cannot take, one error: line (exit 2). The dry-run artifacts the suite builds are
preflighted by trace-and-compile itself (every key before it is written); the combinations no other test
builds are here."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from neuron_moe import cli
from neuron_moe.neuron import compile as nc
from neuron_moe.neuron import preflight as pf
from neuron_moe.config import gemma4_moe_config
from neuron_moe.spec import CHANNEL_READER, Reader
from neuron_moe.static.export import functional


PORT_FILE = Path(__file__).resolve().parents[1] / "ports" / "tiny-gemma4-moe.toml"


def exported(forward, *args, dynamic_shapes=None):
    """`forward` as a module, exported and made functional as trace-and-compile's dry run does."""

    class Graph(torch.nn.Module):
        def forward(self, *xs):
            return forward(*xs)

    return functional(torch.export.export(Graph(), args, dynamic_shapes=dynamic_shapes, strict=False))


def codes(program, target="inf2") -> set[str]:
    return {line.split(":")[0] for line in pf.check_program(program, "g", target)["violations"]}


@torch.library.custom_op("preflight_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


def _cond(x):
    return torch.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, (x,))


i16, i32, i64, f32 = (torch.ones(4, 8, dtype=d) for d in (torch.int16, torch.int32, torch.int64, torch.float32))
GIB5 = 5 * 2**30  # float32 elements: 20 GiB, over an inf2 NeuronCore's 16 GiB, under a trn2 logical core's 24

# rule code -> (a graph that breaks it, one that keeps it, the target), each (forward, args[, dynamic])
SEEDED = {
    "NCC_EVRF022": (
        (lambda x: torch.bitwise_right_shift(x, 2), (i16,)),
        (lambda x: x >> torch.full_like(x, 2), (i32,)),
        "inf2",
    ),
    "NCC_EVRF035": ((lambda x: x @ x.T, (i32,)), (lambda x: x @ x.T, (f32,)), "trn2"),
    "NCC_EVRF031": (
        (lambda x: torch.zeros(3, 8).index_copy(0, torch.arange(4), x), (f32,)),
        (lambda x: torch.zeros(4, 8).index_copy(0, torch.arange(4), x), (f32,)),
        "inf2",
    ),
    "NCC_EVRF062": ((lambda x: x**2, (i64,)), (lambda x: x**2, (i32,)), "inf2"),
    "INT64": ((lambda x: x + 2**40, (i64,)), (lambda x: x + 2**20, (i64,)), "inf2"),
    "U16": ((lambda x: x.to(torch.uint16) == 1, (i32,)), (lambda x: x.to(torch.uint8) == 1, (i32,)), "inf2"),
    "F64": ((lambda x: x.double() * 2, (f32,)), (lambda x: x * 2, (f32,)), "inf2"),
    "NCC_EMOD025": ((lambda x: x + 1, (f32,), {"x": {0: Dim("rows")}}), (lambda x: x + 1, (f32,)), "inf2"),
    "CONTROL_FLOW": ((_cond, (f32,)), (lambda x: torch.where(x.sum() > 0, x + 1, x - 1), (f32,)), "inf2"),
    "NCC_EHCA005": ((lambda x: twice(x), (f32,)), (lambda x: x * 2, (f32,)), "inf2"),
    "NCC_EVRF009": ((lambda x: torch.zeros(GIB5)[:8] + x, (f32,)), (lambda x: torch.zeros(64)[:8] + x, (f32,)), "inf2"),
    "NCC_EVRF013": ((lambda x: torch.topk(x, 2).values, (i32,)), (lambda x: torch.topk(x, 2).values, (f32,)), "inf2"),
}


def _program(case):
    forward, args, *dynamic = case
    if dynamic:
        return exported(forward, *args, dynamic_shapes={"xs": (dynamic[0]["x"],)})
    return exported(forward, *args)


@pytest.mark.parametrize("code", list(SEEDED))
def test_each_seeded_graph_breaks_its_own_rule_alone(code):
    bad, good, target = SEEDED[code]
    assert codes(_program(bad), target) == {code}
    assert codes(_program(good), target) == set()


def test_every_rule_has_a_seeded_graph_and_a_source():
    assert {r.code for r in pf.RULES} == set(SEEDED)
    for rule in pf.RULES:
        assert rule.quote and rule.source.startswith((pf.SDK, pf.NXD)) and rule.name in pf.RULE_NAMES


def test_the_target_decides_int32_dot_and_the_hbm_limit():
    int32_dot = _program(SEEDED["NCC_EVRF035"][0])
    assert codes(int32_dot, "inf2") == codes(int32_dot, "trn1") == set()  # NeuronCore-v2: a warning only
    int64_dot = _program((lambda x: x @ x.T, (i64,)))
    assert codes(int64_dot, "inf2") == {"NCC_EVRF035"}  # int64 on every target
    big = _program(SEEDED["NCC_EVRF009"][0])
    assert codes(big, "trn2") == set()  # 20 GiB: under a trn2 logical NeuronCore's 24


def test_the_report_has_the_histogram_dtypes_largest_and_weights():
    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(16, 8))
            self.register_buffer("state", torch.zeros(4, dtype=torch.int32))

        def forward(self, x):
            return (x @ self.w.T).relu()

    program = functional(torch.export.export(Linear(), (torch.ones(64, 8),), strict=False))
    report = pf.check_program(program, "k")
    assert report["weight_bytes"] == {"parameters": 16 * 8 * 4, "buffers": 16, "constants": 0}
    assert report["largest"]["bytes"] == 64 * 16 * 4 and report["largest"]["shape"] == [64, 16]  # the output
    assert "float32" in report["dtypes"] and sum(report["ops"].values()) >= 2 and report["violations"] == []


def _save(tmp_path, name, case) -> str:
    path = tmp_path / f"{name}.pt2"
    torch.export.save(_program(case), path)
    return str(path)


def test_a_saved_int16_shift_is_refused_naming_evrf022(tmp_path, capsys):
    path = _save(tmp_path, "shift", SEEDED["NCC_EVRF022"][0])
    assert cli.main(["preflight", path]) == 1
    out = capsys.readouterr().out
    assert "NCC_EVRF022: shift node" in out and "Shift-right-arithmetic" in out and "EVRF022.rst" in out


def test_a_saved_int32_matmul_is_refused_for_trn2_naming_evrf035(tmp_path, capsys):
    path = _save(tmp_path, "dot", SEEDED["NCC_EVRF035"][0])
    assert cli.main(["preflight", path, "--target", "trn2", "--json", str(tmp_path / "r.json")]) == 1
    assert "NCC_EVRF035: dot node" in capsys.readouterr().out
    assert cli.main(["preflight", path]) == 0  # inf2, the default: int32 dot only warns there
    assert "clean" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--target", "tpu"], "--target 'tpu': not one of inf2, trn1, trn2"),
        (["--rules", "shift,NCC_EVRF999"], "unknown rule 'NCC_EVRF999'"),
    ],
)
def test_a_wrong_target_or_rule_is_one_error_line(tmp_path, capsys, argv, message):
    path = _save(tmp_path, "ok", SEEDED["F64"][1])
    assert cli.main(["preflight", path, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("kind", ["garbage", "missing", "not an artifact"])
def test_an_unreadable_file_or_artifact_is_one_error_line(tmp_path, capsys, kind):
    path = tmp_path / "x.pt2"
    if kind == "garbage":
        path.write_bytes(b"not a zip")
    elif kind == "not an artifact":
        path = tmp_path / "dir"
        path.mkdir()
    assert cli.main(["preflight", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def test_an_int32_shift_by_a_python_number_is_refused():
    """torch-xla 2.9 lowers `x >> 2` of an int32 x to an s64 shift of x converted (measured on XLA:CPU; the
    4-bit unpack shifts by an int32 tensor instead): what neuronx-cc refuses, so the preflight does."""
    with pytest.raises(pf.PreflightError, match="int32 tensor .* by a Python number, which torch-xla widens to 64"):
        pf.refuse(_program((lambda x: x >> 2, (i32,))), "token_generation")


def test_rules_choose_what_is_checked(tmp_path, capsys):
    path = _save(tmp_path, "shift", SEEDED["NCC_EVRF022"][0])
    assert cli.main(["preflight", path, "--rules", "f64,int-dot"]) == 0
    assert cli.main(["preflight", path, "--rules", "ncc_evrf022"]) == 1


def test_trace_and_compile_refuses_a_key_that_breaks_a_rule():
    """What the dry run calls on every exported key before it writes it: the rule's line, one error."""
    with pytest.raises(pf.PreflightError, match=r"^preflight for inf2: NCC_EVRF022: token_generation node \w+ shifts"):
        pf.refuse(_program(SEEDED["NCC_EVRF022"][0]), "token_generation")
    pf.refuse(_program(SEEDED["NCC_EVRF022"][1]), "token_generation")


# Every format x TP 1, 2, 8 x with and without the reader, where valid (int4 needs whole groups of 32 on a
# rank: at TP 8 a channel rank's 8 intermediate channels hold none, so int4 at TP 8 is the expert layout's;
# the reader is the channel layout's over unquantised experts), preflighted where its graphs are exported:
#   none   TP 1: here        TP 2: tests/test_compile.py (every key, dry run)  TP 8: tests/test_tp_model.py
#   int8   TP 1: here        TP 2: here                                         TP 8: tests/test_tp_model.py
#   int4   TP 1: here        TP 2: tests/test_int4.py (both layouts)            TP 8 (expert): here
#   reader TP 1: tests/test_reader_tp.py (TPGenerator)  TP 2: tests/test_reader_tp.py (dry run)  TP 8: here
# Here: the dry run's own export-and-preflight of the prefill and decode keys (the logits-processing variants
# run the same experts), on the meta device (weights change no op, dtype or shape), of the tiny port's
# geometry with one global layer: the format, the TP split and the reader are the experts', the same ops in
# every layer; the sliding layers are in the exports above. About 3 s a combination on 2 cores.
COMBINATIONS = [
    ("none", 1, "channel", False),
    ("int8", 1, "channel", False),
    ("int8", 2, "channel", False),
    ("int4", 1, "channel", False),
    ("int4", 8, "expert", False),
    ("none", 8, "channel", True),
]


@pytest.fixture(scope="module")
def one_layer_port(tiny_port):
    table = tomllib.loads(PORT_FILE.read_text())["config"]
    config = gemma4_moe_config({**table, "num_hidden_layers": 1, "layer_types": ["full_attention"]}, "one layer")
    static = replace(tiny_port.static, buckets=(8,), prefill_rows=(1,), prefill_chunk=8)
    return replace(tiny_port, config=config, static=static)


@pytest.mark.parametrize("quantization, tp, expert_layout, reader", COMBINATIONS)
def test_the_dry_runs_keys_pass_at_every_format_and_degree(
    one_layer_port, tmp_path, quantization, tp, expert_layout, reader
):
    spec, reads = one_layer_port.static, None
    keys = ["token_generation"] if reader else ["context_encoding_1x8", "token_generation"]
    if reader:  # budget 60 %: at TP 8 a rank's sketch alone is 43 % of its reads on this geometry
        _, reads = nc._plan_reader(one_layer_port, tp, quantization, expert_layout, Reader(budget=60), False)
        spec = replace(spec, decode_experts=CHANNEL_READER.name)
    build = dict(expert_layout=expert_layout, quantization=quantization, dtype=torch.float32, reader=reads)
    nc._dry_run(one_layer_port, spec, keys, tp, None, tmp_path, True, False, build, False)  # raises on a broken rule

"""neuron-moe preflight (neuron/preflight.py): each rule's seeded bad graph flagged with its own code and
nothing else, and a graph beside it that keeps the rule; saved programs refused through the CLI (exit 1);
what preflight cannot take, one error: line (exit 2). The dry-run artifacts the suite builds are
preflighted by trace-and-compile itself (every key before it is written); the combinations no other test
builds are here."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from neuron_moe import cli
from neuron_moe.neuron import preflight as pf
from neuron_moe.static.export import functional


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
    "NCC_EVRF022": ((lambda x: torch.bitwise_right_shift(x, 2), (i16,)), (lambda x: x >> 2, (i32,)), "inf2"),
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


def test_rules_choose_what_is_checked(tmp_path, capsys):
    path = _save(tmp_path, "shift", SEEDED["NCC_EVRF022"][0])
    assert cli.main(["preflight", path, "--rules", "f64,int-dot"]) == 0
    assert cli.main(["preflight", path, "--rules", "ncc_evrf022"]) == 1

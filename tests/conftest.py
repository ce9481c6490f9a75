import os

# The reader's Triton kernels run on the CPU through Triton's interpreter in the tests. Triton
# reads this when it is first imported, and transformers imports it early: set it here, first.
os.environ["TRITON_INTERPRET"] = "1"

import dataclasses

import pytest
import torch

from neuron_moe.model import build_model
from neuron_moe.neuron.preflight import check_program
from neuron_moe.port import load_port


def pytest_terminal_summary(terminalreporter, config):
    """What a run depends on beyond the code, printed even under -q: torch's intra-op threads and the
    random order's seed (pytest-randomly; `make test SEED=N` replays it)."""
    seed = config.getoption("randomly_seed", None)
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    terminalreporter.write_line(
        f"torch threads per process: {torch.get_num_threads()} (OMP_NUM_THREADS={omp}); random-order seed: {seed}"
    )


@pytest.fixture(autouse=True)
def _no_state_from_the_test_before():
    """No test's numbers depend on which tests ran before it (the order is random): torch's global
    generator starts every test from the same seed (pytest-randomly reseeds only `random` and numpy),
    and torch's intra-op threads, which `cli.main` sets for its process (--threads, default
    $OMP_NUM_THREADS else 1), are put back after it."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_port():
    return load_port("tiny-gemma4-moe")


@pytest.fixture(scope="session")
def tiny_eager(tiny_port):
    return build_model(tiny_port, "eager", torch.float32)


def reseeded(port, seed):
    """The same architecture with seeded random weights instead of the port's trained checkpoint."""
    return dataclasses.replace(port, weights_source="random", seed=seed, checkpoint=None)


def port_text_elsewhere(port) -> str:
    """The port file's text for a copy in another folder: its relative checkpoint path made absolute."""
    text = port.path.read_text()
    if port.checkpoint is None:
        return text
    rel = port.raw["weights"]["checkpoint"]
    return text.replace(f'checkpoint = "{rel}"', f'checkpoint = "{port.checkpoint}"')


def with_reader_table(text: str, body: str) -> str:
    """A port file's text with its [reader] table's body replaced by `body` (appended if it has none)."""
    head, found, tail = text.partition("\n[reader]\n")
    rest = tail.split("\n[", 1)
    return f"{head}\n[reader]\n{body}" + (f"\n[{rest[1]}" if found and len(rest) > 1 else "") + "\n"


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


@pytest.fixture
def umask_027():
    """Umask 027 (group may read, others nothing) for the test: a file written as open() would
    is then 0640, a folder 0750; neither 0644 nor 0600 passes by luck."""
    old = os.umask(0o027)
    yield
    os.umask(old)


@pytest.fixture
def one_torch_thread():
    """The tiny model is overhead-bound: one intra-op thread is faster than two on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prefill_logits(model, ids, mask):
    """Teacher-forced logits of a left-padded batch through an HF model (positions skip pads)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()


class MoEBlock(torch.nn.Module):
    """HF's router followed by the experts: the part of a decoder layer an experts implementation replaces."""

    def __init__(self, layer):
        super().__init__()
        self.router, self.experts = layer.router, layer.experts

    def forward(self, x):
        _, weights, index = self.router(x)
        return self.experts(x, index, weights)


_GATHERS = (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)


def preflight_violations(programs: dict) -> list[str]:
    """Every preflight rule (neuron/preflight.py, for inf2) that exported programs break, by name: what the
    dry run refuses, checked on the graphs a test exports anyway (tests/test_preflight.py says which)."""
    return [line for name, program in programs.items() for line in check_program(program, name)["violations"]]


def expert_reads(program) -> dict[str, dict[str, int]]:
    """The experts weights an exported graph reads, by parameter name: "gathered", the elements of
    the slices it indexes out of a parameter (`weight[idx]`, index_select: selective loading);
    "whole", the elements of the parameters it reads in full."""
    params = program.graph_signature.inputs_to_parameters  # placeholder name -> parameter name
    out = {"gathered": {}, "whole": {}}
    for node in program.graph.nodes:
        name = params.get(node.name, "")
        if node.op != "placeholder" or ".experts." not in "." + name or not name.endswith("proj.weight"):
            continue
        for user in node.users:
            if user.target in _GATHERS:
                out["gathered"][name] = out["gathered"].get(name, 0) + user.meta["val"].numel()
            else:
                out["whole"][name] = node.meta["val"].numel()
    return out

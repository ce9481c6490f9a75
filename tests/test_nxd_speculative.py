"""The verify key through NxD's own layers in NxD's CPU mode (`parallel/nxd_generator.py` builds its
rank modules the same way): at TP 2 and 8, each rank's Verify graph, over its shard and a cache k slots
longer, gives the one-rank Verify's tokens and accepted counts (greedy). Runs where NxD is importable
(installed, or the source tree NXD_SRC names); skipped elsewhere: CI has no NxD, as it has no Neuron
device."""

import pytest
import torch

from neuron_moe.greedy import greedy, left_pad
from neuron_moe.parallel import cpu, nxd, nxd_source
from neuron_moe.parallel.model import materialize
from neuron_moe.parallel.rank_job import RankJob
from neuron_moe.parallel.trace import run_ranks
from neuron_moe.spec import tp_backend
from neuron_moe.static.decoder import Prefill, Verify, new_cache
from neuron_moe.static.sampling import greedy_sampling

from conftest import random_prompts

SOURCE = nxd_source.locate()  # a bad NXD_SRC is an error here, not a skip
pytestmark = pytest.mark.skipif(
    SOURCE is None,
    reason="neuronx-distributed is not importable: not installed, and NXD_SRC names no source tree "
    "(CI has no NxD, as it has no Neuron device)",
)

K = 4


def _verify(model, spec, prompts: list[list[int]], inputs: tuple) -> tuple:
    """Each prompt prefilled into its own row of a cache k slots longer, then one verify call."""
    cache = new_cache(model, spec.max_cache_len, len(prompts), slack=K)
    prefill = Prefill(model, cache, spec.prefill_experts)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        ids, ones = torch.tensor([prompt]), torch.ones(1, n, dtype=torch.long)
        prefill(ids, ones, torch.arange(n)[None], torch.tensor([row]), greedy_sampling(1))
    tokens, accepted, *_ = Verify(model, cache, spec.decode_experts)(*inputs)
    return tokens, accepted


def _rank(rank: int, source, job: RankJob, prompts, inputs) -> tuple:
    """One rank process: NxD's CPU mode and parallel state, its rank module over NxD's layers with its
    shard, then `_verify`; with the NxD classes its module is built of."""
    nxd_source.activate(source)
    nxd.initialize_model_parallel(job.tp)
    module = job.rank_module(nxd, device="meta")
    state = cpu.shard_checkpoint(job.full, module, job.tp)[rank]
    materialize(module, job.config, job.tp, job.expert_layout)
    module.load_state_dict(state, strict=True)
    classes = {type(m).__name__ for m in module.modules() if type(m).__module__.startswith(nxd_source.PACKAGE)}
    return _verify(module, job.spec, prompts, inputs), classes


@pytest.fixture(scope="module")
def case(tiny_port, tiny_eager):
    """Two rows at different positions (prompts of 14 and 9 tokens), each fed its greedy token with
    drafts that are greedy's next two, then a wrong one (row 0: then greedy's again); the one-rank
    Verify's answer over HF's model: 2 accepted per row, its tokens greedy's up to the correction."""
    prompts = random_prompts(tiny_port.config.vocab_size, [14, 9], seed=57)
    rows = []
    for prompt in prompts:
        rows.append(greedy(tiny_eager, *left_pad([prompt], 0), K + 1).tokens[0].tolist())
    drafts = [rows[0][1:3] + [(rows[0][3] + 1) % 2048] + rows[0][4:], rows[1][1:3] + [5, 6]]
    ids = torch.tensor([[row[0], *d] for row, d in zip(rows, drafts)])
    positions = torch.tensor([[len(p) + i for i in range(K + 1)] for p in prompts])
    inputs = (ids, positions, greedy_sampling(2), torch.tensor([K, K]), torch.zeros(2, K + 1))
    want = _verify(tiny_eager, tiny_port.static, prompts, inputs)
    assert want[1].tolist() == [2, 2] and torch.equal(want[0][:, :3], torch.tensor(rows)[:, 1:4])  # greedy's own
    return prompts, inputs, want


@pytest.mark.parametrize("tp", [2, 8])
def test_the_verify_key_over_nxds_layers_is_the_one_rank_verify(tiny_port, case, tp):
    prompts, inputs, (tokens, accepted) = case
    job = RankJob.prepare(tiny_port, tp_backend(tp, layers="nxd"))
    results = run_ranks(tp, _rank, SOURCE, job, prompts, inputs)
    for (got_tokens, got_accepted), classes in results:
        assert torch.equal(got_tokens, tokens) and torch.equal(got_accepted, accepted)
        assert {"ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding"} <= classes

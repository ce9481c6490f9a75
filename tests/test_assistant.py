"""The MTP assistant: the static draft graph (`static/draft.py`) against HF's candidate generator."""

import copy
import dataclasses
import json
import warnings

import pytest
import torch
from transformers import GenerationConfig, Gemma4AssistantForCausalLM
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from neuron_moe.checkpoint import CheckpointError
from neuron_moe.hub import read_assistant_config, resolve_assistant
from neuron_moe.port import load_port
from neuron_moe.static import data_dependent_ops, ops_not_lowered
from neuron_moe.static.cache import SLIDING, KVCache, cache_layout
from neuron_moe.static.decoder import Prefill
from neuron_moe.static.draft import Draft, load_assistant, shared_layers
from neuron_moe.static.export import functional
from neuron_moe.static.rows import Chunk, GraphRuntime
from neuron_moe.static.runtime import static_runtime
from neuron_moe.static.sampling import GREEDY
from neuron_moe.tokenizer import load_tokenizer
from neuron_moe.training.assistant import acceptance, assistant_config, teacher, unrolled

from conftest import random_prompts

K = 4
MAX_CACHE_LEN = 96


def random_assistant(target_config, seed: int = 0) -> Gemma4AssistantForCausalLM:
    """A small assistant over the target, HF's initialisation from `seed`, its norms perturbed (HF sets
    them to 1: a norm applied twice or skipped would not show) and its projections scaled up (at HF's
    0.02 the drafts would hardly depend on the target's state)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma4AssistantForCausalLM(assistant_config(target_config, hidden_size=64, intermediate_size=128))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(0.2 * torch.randn(param.shape))
                elif name.endswith("proj.weight"):
                    param.mul_(10.0)
    model.set_attn_implementation("eager")
    return model.eval()


@pytest.fixture(scope="module")
def assistant(tiny_port):
    return random_assistant(tiny_port.config)


def hf_drafts(target, assistant, prompt: list[int], k: int):
    """HF's candidate generator on its first round: the target prefilled with `prompt`, its greedy
    token appended -> (that token, the target's hidden state at the prompt's last position, the k
    drafts [k], their logits [k, V])."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True)
    bonus = out.logits[:, -1].argmax(-1, keepdim=True)
    ids = torch.cat([ids, bonus], dim=1)
    assistant.generation_config.num_assistant_tokens = k
    gen = SinglePositionMultiTokenCandidateGenerator(
        assistant, target.get_input_embeddings(), GenerationConfig(max_length=ids.shape[1] + k + 1)
    )
    mask = torch.ones_like(ids)
    candidates, logits = gen.get_candidates(
        ids, model_kwargs={"attention_mask": mask}, model_outputs=out, is_first_iteration=False, n_last_matches=0
    )
    return int(bonus), out.hidden_states[-1][0, -1], candidates[0, ids.shape[1] :], logits[0]


def widened(layout, length: int):
    """`layout` with every sliding ring `length` slots long."""
    return [dataclasses.replace(spec, length=length) if spec.kind == SLIDING else spec for spec in layout]


def prefilled(model, layout, prompts: list[list[int]], bucket: int = 56) -> KVCache:
    """A KV cache with row b holding `prompts[b]`, written by the static Prefill graph a chunk of at
    most `bucket` tokens at a time (a long prompt's later chunks attend to its ring)."""
    cache = KVCache(layout, len(prompts), torch.float32)
    runtime = GraphRuntime(Prefill(model, cache, "dense_masked"), None, _shapes(len(prompts), bucket))
    for row, prompt in enumerate(prompts):
        for start in range(0, len(prompt), bucket):
            runtime.prefill([Chunk(prompt[start : start + bucket], start, row, GREEDY)])
    return cache


def _shapes(batch: int, bucket: int):
    from neuron_moe.run_config import Shapes

    return Shapes(batch_size=batch, buckets=[bucket], max_cache_len=MAX_CACHE_LEN)


# rows at positions inside the window, just past it (W + 1, W + 2), and far past it over several chunks
LENGTHS = [5, 17, 18, 40, 75]


@pytest.mark.parametrize("ring", ["window + k + 1", "whole rows"])
def test_the_draft_graph_drafts_what_hfs_candidate_generator_drafts(tiny_port, tiny_eager, assistant, ring):
    """Rows at different positions, some past the sliding window, over the static Prefill graph's
    cache: the draft graph's tokens are HF's, its logits HF's to fp32 rounding of a few small layers."""
    config = tiny_port.config
    layout = cache_layout(config, MAX_CACHE_LEN, whole_rows=ring == "whole rows")
    if ring != "whole rows":
        layout = widened(layout, config.sliding_window + K + 1)
    prompts = random_prompts(config.vocab_size, LENGTHS, seed=3)
    cache = prefilled(tiny_eager, layout, prompts)
    expected = [hf_drafts(tiny_eager, assistant, p, K) for p in prompts]
    draft = Draft(assistant, tiny_eager, cache, K)
    with torch.no_grad():
        tokens, logits = draft(
            torch.tensor([e[0] for e in expected]),
            torch.stack([e[1] for e in expected]),
            torch.tensor([len(p) for p in prompts]),
        )
    assert tokens.shape == (len(prompts), K) and logits.shape == (len(prompts), K, config.vocab_size)
    for row, (_, _, hf_tokens, hf_logits) in enumerate(expected):
        assert tokens[row].tolist() == hf_tokens.tolist(), f"row {row} at position {LENGTHS[row]}"
        torch.testing.assert_close(logits[row], hf_logits.float(), rtol=1e-4, atol=1e-4)
    # the drafts differ from row to row: the comparison is not of constants
    assert len({tuple(t) for t in tokens.tolist()}) == len(prompts)


def test_the_draft_reads_the_window_plus_one_positions_before_its_query(tiny_port, tiny_eager, assistant):
    """One position more or less in a sliding layer changes the drafts: what the test above holds is
    the window HF's assistant reads (W + 1 positions), not a near miss."""
    config = tiny_port.config
    layout = widened(cache_layout(config, MAX_CACHE_LEN), config.sliding_window + K + 1)
    prompt = random_prompts(config.vocab_size, [40], seed=5)[0]
    cache = prefilled(tiny_eager, layout, [prompt])
    bonus, hidden, hf_tokens, hf_logits = hf_drafts(tiny_eager, assistant, prompt, K)
    inputs = (torch.tensor([bonus]), hidden[None], torch.tensor([len(prompt)]))
    for window in (config.sliding_window - 1, config.sliding_window + 1):
        draft = Draft(assistant, tiny_eager, cache, K)
        draft.window = window
        with torch.no_grad():
            _, logits = draft(*inputs)
        assert not torch.allclose(logits[0], hf_logits.float(), rtol=1e-4, atol=1e-4), window


def test_a_ring_shorter_than_the_window_plus_one_is_refused(tiny_port, tiny_eager, assistant):
    cache = KVCache(cache_layout(tiny_port.config, MAX_CACHE_LEN), 1, torch.float32)
    with pytest.raises(ValueError, match="holds 16 positions: the draft reads the 17 before its query"):
        Draft(assistant, tiny_eager, cache, K)


def test_the_assistant_reads_the_last_sliding_and_the_last_full_attention_layer(tiny_port):
    assert shared_layers(tiny_port.config) == {SLIDING: 2, "full_attention": 3}


def test_the_draft_graph_exports_with_fixed_shapes_the_cache_read_only_and_no_data_dependent_op(
    tiny_port, tiny_eager, assistant
):
    config = tiny_port.config
    layout = widened(cache_layout(config, MAX_CACHE_LEN), config.sliding_window + K + 1)
    cache = KVCache(layout, 3, torch.float32)
    draft = Draft(assistant, tiny_eager, cache, K)
    inputs = (torch.tensor([5, 6, 7]), torch.randn(3, config.hidden_size), torch.tensor([3, 20, 60]))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="While compiling, we found certain side effects")
        program = functional(torch.export.export(draft, inputs, strict=True))
    assert data_dependent_ops(program) == [] and ops_not_lowered(program) == []  # bench/results/xla-check-new.md
    sig = program.graph_signature
    assert not sig.buffers_to_mutate  # reads the target's KV, writes nothing
    nodes = {n.name: n for n in program.graph.nodes}
    shapes = [tuple(nodes[o].meta["val"].shape) for o in sig.user_outputs]
    assert shapes == [(3, K), (3, K, config.vocab_size)]
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    assert all(type(d) is int for n in placeholders for d in n.meta["val"].shape)
    with torch.no_grad():
        eager = draft(*inputs)
        exported = program.module()(*inputs)
    assert torch.equal(eager[0], exported[0])


def test_the_runtime_drafts_over_the_cache_its_prefill_graph_wrote(tiny_port, tiny_eager, assistant):
    """`static_runtime(..., assistant=)`: the draft graph over the runtime's own cache (the whole-row
    layout: its sliding rings hold every position), called through `GraphRuntime.draft`."""
    runtime = static_runtime(tiny_eager, tiny_port.static, 2, prefix_caching=True, assistant=assistant, draft_tokens=3)
    prompts = random_prompts(tiny_port.config.vocab_size, [30, 9], seed=7)
    tokens, _ = runtime.prefill([Chunk(p, 0, row, GREEDY) for row, p in enumerate(prompts)])
    expected = [hf_drafts(tiny_eager, assistant, p, 3) for p in prompts]
    assert tokens.tolist() == [e[0] for e in expected]
    drafts, logits = runtime.draft(tokens, torch.stack([e[1] for e in expected]), torch.tensor([30, 9]))
    assert drafts.tolist() == [e[2].tolist() for e in expected] and logits.shape == (2, 3, tiny_port.config.vocab_size)


# The committed assistant (ports/tiny-gemma4-moe-assistant) and HF's assisted generation as its reference


@pytest.fixture(scope="module")
def trained(tiny_eager):
    return load_assistant(resolve_assistant("tiny-gemma4-moe-assistant"), tiny_eager)


def test_the_built_in_assistant_resolves_beside_the_tiny_checkpoint_and_a_directory_by_its_path(tiny_port):
    path = resolve_assistant("tiny-gemma4-moe-assistant")
    assert path == tiny_port.checkpoint.parent / "tiny-gemma4-moe-assistant"
    assert resolve_assistant(str(path)) == path
    assert sum(f.stat().st_size for f in path.iterdir()) < 16 * 2**20


def test_an_assistant_that_does_not_fit_the_target_is_one_error_naming_the_field(tiny_port, tmp_path):
    source = resolve_assistant("tiny-gemma4-moe-assistant")
    raw = json.loads((source / "config.json").read_text())
    for edit, message in [
        (lambda c: c["text_config"].update(vocab_size=4096), "vocab_size 4096 does not fit the target's 2048"),
        (lambda c: c.update(backbone_hidden_size=256), "backbone_hidden_size 256 does not fit the target's 128"),
        (lambda c: c.update(model_type="gemma4_text"), "not a Gemma-4 assistant"),
        (lambda c: c["text_config"].update(num_hidden_layers=10**9), r"num_hidden_layers = 1000000000 is not"),
    ]:
        config = copy.deepcopy(raw)
        edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=message):
            read_assistant_config(tmp_path, tiny_port.config)
    with pytest.raises(CheckpointError, match=r"assistant .*nowhere: no config.json"):
        resolve_assistant(str(tmp_path / "nowhere"))


def test_hf_assisted_generation_with_the_trained_assistant_is_the_targets_greedy_and_accepts_its_drafts(
    tiny_eager, trained
):
    """HF's `generate(..., assistant_model=)`, greedy: exactly the target's own tokens, and the
    trained assistant's drafts accepted far above chance (1/2048 a draft) on held-out prose."""
    tokenizer = load_tokenizer(load_port("tiny-gemma4-moe"))
    prompts = [tokenizer.encode(text) for text in PROSE]
    got = acceptance(tiny_eager, trained, prompts, K, new_tokens=24)
    assert got["greedy_equal"] and got["rounds"] >= len(prompts)
    assert got["mean_accepted"] >= 1.5, got  # 2.2 of 4 with the committed weights
    assert got["per_position"] == sorted(got["per_position"], reverse=True)  # a draft needs the ones before it


# the openings of three documents of the corpus's evaluation split (eval_text.jsonl: fortunes whose hash
# puts them there, never trained on)
PROSE = [
    "A man from AI walked across the mountains to SAIL to see the Master,",
    "As the trials of life continue to take their toll, remember that there",
    "But in our enthusiasm, we could not resist a radical overhaul of the",
]


def test_training_runs_the_assistant_as_the_draft_graph_runs_it(tiny_port, tiny_eager, assistant):
    """Teacher forcing (`training/assistant.py`) over a window gives, at each query position p, the
    draft graph's first step for a row prefilled up to p - 1 with the token at p as its last: the
    same inputs, masks and position, so what is trained is what runs."""
    config = tiny_port.config
    ids = torch.tensor(random_prompts(config.vocab_size, [48], seed=11))
    positions = torch.tensor([3, 16, 17, 18, 40])
    batch = teacher(tiny_eager, ids)
    (trained_logits, target_logits), _ = unrolled(assistant, batch, positions, 2, config.sliding_window)
    layout = widened(cache_layout(config, MAX_CACHE_LEN), config.sliding_window + K + 1)
    prompts = [ids[0, :p].tolist() for p in positions]
    draft = Draft(assistant, tiny_eager, prefilled(tiny_eager, layout, prompts), 1)
    with torch.no_grad():
        _, logits = draft(ids[0, positions], batch[1][0, positions - 1], positions)
    torch.testing.assert_close(trained_logits[0].detach(), logits[:, 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(target_logits[0], batch[3][0, positions])  # labels: the target's next token there

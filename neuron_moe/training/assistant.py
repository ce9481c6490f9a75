"""`neuron-moe train-assistant`: Gemma-4's MTP assistant for a trained target, by teacher forcing.

The assistant is transformers' `Gemma4AssistantForCausalLM` (as Google's for Gemma-4: 4 layers that
read the target's KV and keep none of their own, `static/draft.py`), its text config small and its
attention geometry the target's: the head dims, KV-head counts, window and rotary embeddings of the
target's sliding and full-attention layers, whose KV its layers of each type attend over.
"""

from __future__ import annotations

import copy
import json
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from .. import spec
from ..errors import UserError
from ..model import build_model
from ..port import load_port
from ..report import atomic_dir, native_write_errors
from ..tokenizer import load_tokenizer
from .corpus import read_jsonl
from .tiny import Windows, lr_at, repeatable

SLIDING, FULL = "sliding_attention", "full_attention"


def assistant_config(
    target, hidden_size: int = 128, layers: int = 4, heads: int = 4, intermediate_size: int = 256
) -> Gemma4AssistantConfig:
    """The config of an assistant for `target` (a Gemma4TextConfig): `layers` layers, the last one full
    attention and the others sliding (Google's assistants: 3 sliding, 1 full), over the target's
    vocabulary, with `backbone_hidden_size` the target's hidden size."""
    per_layer = {kind: target.per_layer_config[target.layer_types.index(kind)] for kind in (SLIDING, FULL)}
    text = Gemma4TextConfig(
        vocab_size=target.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=per_layer[SLIDING].num_key_value_heads,
        head_dim=per_layer[SLIDING].head_dim,
        global_head_dim=per_layer[FULL].head_dim,
        num_global_key_value_heads=per_layer[FULL].num_key_value_heads,
        attention_k_eq_v=target.attention_k_eq_v,
        layer_types=[SLIDING] * (layers - 1) + [FULL],
        sliding_window=target.sliding_window,
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters=copy.deepcopy(target.rope_parameters),
        rms_norm_eps=target.rms_norm_eps,
        hidden_activation=target.hidden_activation,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        enable_moe_block=False,
        final_logit_softcapping=None,
        tie_word_embeddings=True,
        pad_token_id=target.pad_token_id,
        eos_token_id=target.eos_token_id,
        bos_token_id=target.bos_token_id,
    )
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.hidden_size)
    config.validate_architecture()
    return config


def teacher(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    """The frozen target over windows `ids` [B, T] -> (its scaled embeddings of the ids [B, T, H], its
    final hidden states [B, T, H] (post-norm: HF's hidden_states[-1]), the KV its assistant reads,
    per layer type [B, kv_heads, T, head_dim], its logits [B, T, V])."""
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True)
        embeds = target.model.embed_tokens(ids)
    shared = {kind: (k.detach(), v.detach()) for kind, (k, v) in out.shared_kv_states.items()}
    return embeds, out.hidden_states[-1], shared, out.logits.float()


def window_masks(length: int, positions: torch.Tensor, window: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The additive masks [1, 1, Q, length] of queries at `positions` [Q] over the target's KV of
    positions 0..length-1: what the draft graph reads at each query (`static/draft.py`): every
    position before it, and in a sliding layer the window + 1 before it."""
    query, key = positions[:, None], torch.arange(length)[None, :]
    before = key < query
    allowed = {FULL: before, SLIDING: before & (query - key <= window + 1)}
    return {
        kind: torch.zeros(a.shape, dtype=dtype).masked_fill(~a, torch.finfo(dtype).min)[None, None]
        for kind, a in allowed.items()
    }


def unrolled(assistant, batch: tuple, positions: torch.Tensor, k: int, window: int) -> list[tuple]:
    """The assistant's k draft steps at query positions `positions` [Q] (each in 1..T-k) of the
    windows, teacher-forced as the draft graph runs them: step j reads the token at p + j - 1 (the
    last one, at p, for step 1) beside the target's hidden state at p - 1 (step 1) or its own
    projected state of the step before, at position id p, and predicts the token after p + j - 1. Per
    step: (the assistant's logits [B, Q, V], the target's there). The queries are independent (each
    reads only the target's KV), so any subset of positions trains as the whole would."""
    embeds, hidden, shared, target_logits = batch
    masks = window_masks(embeds.shape[1], positions, window, embeds.dtype)
    position_ids = positions[None].expand(embeds.shape[0], -1)
    state = hidden[:, positions - 1]
    steps = []
    for j in range(1, k + 1):
        inputs = assistant.pre_projection(torch.cat([embeds[:, positions + j - 1], state], dim=-1))
        out = assistant.model(
            inputs_embeds=inputs,
            attention_mask=masks,
            position_ids=position_ids,
            shared_kv_states=shared,
            logits_to_keep=None,  # every query: transformers' default (0) would slice for one
        ).last_hidden_state
        steps.append((assistant.lm_head(out), target_logits[:, positions + j - 1]))
        state = assistant.post_projection(out)
    return steps


def step_loss(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cross-entropy of the assistant's logits against the target's next-token distribution, the
    share of queries whose greedy draft is the target's greedy token: what a verify accepts)."""
    loss = -(target.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    return loss, (logits.argmax(-1) == target.argmax(-1)).float().mean()


def windows(tokenizer, corpus_dir: Path, seq_len: int, seed: int, eos: int, task_share: float) -> Windows:
    """The training windows of the target's own corpus, packed as `train-tiny` packs them: whole task
    items up to `task_share` of each window, running text the rest."""
    rows = read_jsonl(Path(corpus_dir) / "train.jsonl")
    encoded = [e.ids + [eos] for e in tokenizer.backend.encode_batch([r["text"] for r in rows])]
    tasks = [ids for r, ids in zip(rows, encoded) if r["kind"] != "text"]
    text = [ids for r, ids in zip(rows, encoded) if r["kind"] == "text"]
    return Windows(tasks, text, seq_len, random.Random(seed), task_share)


def new_assistant(target, seed: int) -> Gemma4AssistantForCausalLM:
    """HF's initialisation from `seed`; the output embedding (tied to the input one, which the
    assistant never reads) starts as the target's own where the widths agree, as Google's share it."""
    torch.manual_seed(seed)
    assistant = Gemma4AssistantForCausalLM(assistant_config(target.config))
    table = target.model.embed_tokens.weight
    if assistant.lm_head.weight.shape == table.shape:
        with torch.no_grad():
            assistant.lm_head.weight.copy_(table)
    return assistant


def train(
    target,
    tokenizer,
    corpus_dir: Path,
    *,
    steps: int = 800,
    draft_steps: int = 4,
    batch_size: int = 2,
    seq_len: int = 512,
    queries: int = 128,
    task_share: float = 0.05,
    lr: float = 2e-3,
    seed: int = 0,
    threads: int = 1,
    progress: bool = True,
) -> dict:
    """Train an assistant for the frozen `target` on the corpus -> (the assistant, the run's summary).
    Each step: `batch_size` windows of `seq_len` tokens through the target, the assistant's
    `draft_steps` steps unrolled at `queries` positions of each. The target runs with sdpa and
    grouped_mm experts meanwhile (speed; its outputs are the same function) and eager after."""
    if draft_steps >= seq_len:
        raise UserError(f"--draft-steps {draft_steps}: at most --seq-len - 1 ({seq_len - 1})")
    data = windows(tokenizer, corpus_dir, seq_len, seed, target.config.eos_token_id, task_share)
    with repeatable(threads):
        assistant = new_assistant(target, seed)
        assistant.set_attn_implementation("sdpa")
        target.set_attn_implementation("sdpa")
        spec.set_experts(target, "grouped_mm")
        target.eval().requires_grad_(False)
        picks, window = torch.Generator().manual_seed(seed), target.config.sliding_window
        opt = torch.optim.AdamW(assistant.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        log, start = [], time.time()
        bar = tqdm(range(steps), desc="train-assistant", disable=not progress)
        for step in bar:
            ids = torch.tensor([data.window() for _ in range(batch_size)])
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
            positions = 1 + torch.randperm(seq_len - draft_steps, generator=picks)[:queries].sort().values
            batch = teacher(target, ids)
            per_step = [step_loss(*step) for step in unrolled(assistant, batch, positions, draft_steps, window)]
            loss = sum(s[0] for s in per_step) / draft_steps
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(assistant.parameters(), 1.0)
            opt.step()
            log.append(
                {
                    "step": step,
                    "loss": [round(s[0].item(), 4) for s in per_step],
                    "match": [round(s[1].item(), 4) for s in per_step],
                }
            )
            bar.set_postfix(loss=f"{loss.item():.3f}", match1=f"{log[-1]['match'][0]:.2f}")
    summary = {
        "seed": seed,
        "steps": steps,
        "draft_steps": draft_steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "queries": queries,
        "task_share": task_share,
        "lr": lr,
        "threads": threads,
        "seconds": round(time.time() - start, 1),
        "final_loss": log[-1]["loss"],
        "final_match": log[-1]["match"],
        "log": log,
    }
    target.set_attn_implementation("eager")
    spec.set_experts(target, spec.EAGER)
    assistant.set_attn_implementation("eager")
    return assistant.eval(), summary


def save(assistant, summary: dict, out_dir: Path) -> None:
    """The assistant's directory (HF's layout: config.json, model.safetensors; and train_log.json),
    built beside `out_dir` and renamed onto it."""
    with atomic_dir(out_dir) as tmp, native_write_errors(out_dir):
        assistant.save_pretrained(tmp)
        (tmp / LOG).write_text(json.dumps(summary, indent=1) + "\n")


LOG = "train_log.json"


@contextmanager
def counted_rounds():
    """Yield a list that collects, for every verify round of HF's assisted generation with a Gemma-4
    assistant inside the block, how many of its drafts the target accepted (HF's own count, which
    its candidate generator is told after each round; the prefill, with no drafts, is not a round)."""
    cls = SinglePositionMultiTokenCandidateGenerator
    before, rounds = cls.update_candidate_strategy, []

    def update(self, input_ids, scores, num_matches):
        if scores.shape[1] > 1:  # drafts were verified
            rounds.append((int(num_matches), scores.shape[1] - 1))
        return before(self, input_ids, scores, num_matches)

    cls.update_candidate_strategy = update
    try:
        yield rounds
    finally:
        cls.update_candidate_strategy = before


def acceptance(target, assistant, prompts: list[list[int]], k: int, new_tokens: int) -> dict:
    """HF's greedy assisted generation of `new_tokens` after each prompt with k drafts a round: the
    mean drafts accepted per round, tokens per round (accepted + the target's own), the acceptance at
    each draft position, and whether every output is the target's own greedy one (it must be)."""
    assistant.generation_config.num_assistant_tokens = k
    same, rounds = True, []
    with counted_rounds() as counted, torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            options = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            assisted = target.generate(ids, assistant_model=assistant, **options)
            same = same and torch.equal(assisted, target.generate(ids, **options))
        rounds = [m for m, drafted in counted if drafted == k]  # a round cut short by the length is not counted
    accepted = sum(rounds) / max(1, len(rounds))
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "k": k,
        "rounds": len(rounds),
        "mean_accepted": round(accepted, 3),
        "tokens_per_round": round(accepted + 1, 3),
        "per_position": [round(sum(m > i for m in rounds) / max(1, len(rounds)), 3) for i in range(k)],
        "greedy_equal": same,
    }


# HF's assisted generation on held-out text after training: prompts of PROMPT_TOKENS tokens (the BOS
# included) from the first EVAL_DOCS evaluation documents that long, NEW_TOKENS generated after each
EVAL_DOCS, PROMPT_TOKENS, NEW_TOKENS = 8, 24, 32


def eval_prompts(tokenizer, corpus_dir: Path) -> list[list[int]]:
    """The acceptance measurement's prompts: held-out prose (eval_text.jsonl), never trained on."""
    docs = [tokenizer.encode(r["text"]) for r in read_jsonl(Path(corpus_dir) / "eval_text.jsonl")]
    return [ids[:PROMPT_TOKENS] for ids in docs if len(ids) >= PROMPT_TOKENS][:EVAL_DOCS]


def train_for_port(model: str, corpus_dir: Path, out_dir: Path, *, checkpoint=None, **options) -> dict:
    """`train-assistant`: an assistant for port `model`'s target (its weights, or `checkpoint`'s),
    trained (`train`), its acceptance measured (`acceptance`), written to `out_dir` (`save`)."""
    port = load_port(model)
    target = build_model(port, spec.EAGER, torch.float32, checkpoint)
    tokenizer = load_tokenizer(port, checkpoint)
    assistant, summary = train(target, tokenizer, corpus_dir, **options)
    k = summary["draft_steps"]
    summary["acceptance"] = acceptance(target, assistant, eval_prompts(tokenizer, corpus_dir), k, NEW_TOKENS)
    save(assistant, summary, out_dir)
    return summary


def render_assistant(summary: dict, out) -> str:
    got = summary["acceptance"]
    return (
        f"wrote {out}: {summary['steps']} steps, {summary['seconds']:.0f} s; HF assisted generation on "
        f"{got['prompts']} held-out prompts: {got['mean_accepted']} of {got['k']} drafts accepted per round "
        f"(per position {got['per_position']}), greedy output the target's: {got['greedy_equal']}"
    )

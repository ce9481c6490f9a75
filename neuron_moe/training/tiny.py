"""`neuron-moe train-tiny`: train the embedded default model on the corpus, deterministically.

The model is transformers' Gemma4ForCausalLM with the port's config (HF's own initialisation
from the seed); the tokenizer is a byte-level BPE trained with HF `tokenizers` on the training
split, digits always single tokens (so arithmetic sees one token per digit). Training packs whole
task items into fixed windows and fills the rest of each window with running text; the loss is
next-token cross-entropy plus a load-balancing term on the router probabilities, so that no
expert goes unused. Everything random comes from `seed`: two runs with the same seed and thread
count give the same loss curve.
"""

from __future__ import annotations

import json
import math
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import Gemma4ForCausalLM, PreTrainedTokenizerFast

from .. import spec
from ..checkpoint import write_checkpoint
from ..errors import UserError
from ..report import atomic_dir, native_write_errors
from .corpus import read_jsonl

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"  # ids 0, 1, 2: the port config's pad/eos/bos ids
LOG = "train_log.json"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 2)])
    if tok.get_vocab_size() != vocab_size:
        raise UserError(f"tokenizer: trained {tok.get_vocab_size()} tokens, the port wants vocab_size {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


class Windows:
    """Fixed-length training windows: whole task items first (up to `task_share` of the window),
    the rest running text. Items never straddle a window, so each is seen with its prompt."""

    def __init__(
        self,
        task_docs: list[list[int]],
        text_docs: list[list[int]],
        seq_len: int,
        rng: random.Random,
        task_share: float,
    ):
        self.tasks, self.seq_len, self.rng, self.task_share = task_docs, seq_len, rng, task_share
        self.text = [t for doc in text_docs for t in doc]
        self.order: list[int] = []
        self.text_pos = 0
        too_long = [len(d) for d in task_docs if len(d) > seq_len]
        if too_long:
            raise UserError(f"a task item of {max(too_long)} tokens does not fit --seq-len {seq_len}")

    def _next_task(self) -> list[int]:
        if not self.order:  # a new epoch of the items, in a fresh seeded order
            self.order = list(range(len(self.tasks)))
            self.rng.shuffle(self.order)
        return self.tasks[self.order[-1]]

    def window(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.task_share * self.seq_len and len(out) + len(self._next_task()) <= self.seq_len:
            out += self._next_task()
            self.order.pop()
        while len(out) < self.seq_len:
            take = self.text[self.text_pos : self.text_pos + self.seq_len - len(out)]
            out += take
            self.text_pos = (self.text_pos + len(take)) % len(self.text)
        return out


def balance_loss(probs: list[torch.Tensor], index: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Switch-Transformer load balancing, averaged over layers: E * sum_e f_e * P_e, where f_e is
    the share of top-k slots routed to expert e and P_e its mean router probability. It is 1 at
    perfect balance (in expectation) and grows as routing concentrates."""
    total = 0.0
    for p, idx in zip(probs, index):
        f = torch.bincount(idx.flatten(), minlength=num_experts).float() / idx.numel()
        total = total + num_experts * (f * p.mean(0)).sum()
    return total / len(probs)


@contextmanager
def repeatable(threads: int):
    """`threads` torch threads and deterministic algorithms, restored after. On more than one
    thread some CPU backward kernels accumulate in a varying order (measured: two 2-thread runs of
    the same seed differ from the second step's loss on); deterministic algorithms make a run
    repeatable at any fixed thread count."""
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    config,
    corpus_dir: Path,
    out_dir: Path,
    *,
    steps: int,
    batch_size: int = 4,
    seq_len: int = 512,
    lr: float = 3e-3,
    balance_coef: float = 0.01,
    task_share: float = 1.0,
    seed: int = 0,
    threads: int = 1,
    progress: bool = True,
) -> dict:
    """Train and write an HF-layout checkpoint directory (weights, config, tokenizer, train_log.json)."""
    if not 0 < task_share <= 1:
        raise UserError(f"task share {task_share}: must be in (0, 1]")
    rows = read_jsonl(Path(corpus_dir) / "train.jsonl")
    tokenizer = train_tokenizer([r["text"] for r in rows], config.vocab_size)
    encoded = tokenizer([r["text"] for r in rows])["input_ids"]
    eos = tokenizer.eos_token_id
    # Fact paragraphs are packed like task items: as filler at the ends of windows, the statements
    # were too rarely seen for the Q/A form to recall them (fact 14 % with them in the text).
    task_docs = [ids + [eos] for r, ids in zip(rows, encoded) if r["kind"] != "text"]
    text_docs = [ids + [eos] for r, ids in zip(rows, encoded) if r["kind"] == "text"]
    windows = Windows(task_docs, text_docs, seq_len, random.Random(seed), task_share)

    with repeatable(threads):
        torch.manual_seed(seed)
        model = Gemma4ForCausalLM(config)
        model.set_attn_implementation("sdpa")  # training speed; the saved weights do not depend on it
        spec.set_experts(model, "grouped_mm")
        model.train()
        captured: list[tuple] = []
        for layer in model.model.layers:
            layer.router.register_forward_hook(lambda m, i, out: captured.append((out[0], out[2])))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

        log = []
        start = time.time()
        bar = tqdm(range(steps), desc="train-tiny", disable=not progress)
        for step in bar:
            ids = torch.tensor([windows.window() for _ in range(batch_size)])
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
            captured.clear()
            lm_loss = model(input_ids=ids, labels=ids).loss
            aux = balance_loss([c[0] for c in captured], [c[1] for c in captured], config.num_experts)
            loss = lm_loss + balance_coef * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            log.append({"step": step, "loss": lm_loss.item(), "balance": aux.item()})
            bar.set_postfix(loss=f"{lm_loss.item():.3f}", balance=f"{aux.item():.3f}")
    elapsed = time.time() - start

    model.eval()
    summary = {
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "lr": lr,
        "balance_coef": balance_coef,
        "task_share": task_share,
        "threads": threads,
        "tokens": steps * batch_size * seq_len,
        "seconds": round(elapsed, 1),
        "final_loss": log[-1]["loss"],
        "log": log,
    }
    with atomic_dir(out_dir) as tmp, native_write_errors(out_dir):
        write_checkpoint(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / LOG).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def render_training(summary: dict, out) -> str:
    return (
        f"wrote {out}: {summary['steps']} steps, {summary['tokens']} tokens, "
        f"{summary['seconds']:.0f} s, final loss {summary['final_loss']:.4f}"
    )

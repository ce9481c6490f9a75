"""The tiny model's corpus, training run and task suite: splits that hold items out, a training run
that reproduces, scoring that is exact, and the committed model's quality."""

import copy
import json
import random

import pytest
import torch

from neuron_moe import cli
from neuron_moe.checkpoint import load_checkpoint
from neuron_moe.errors import UserError
from neuron_moe import tasks as T
from neuron_moe.eval.seq_match import BACKENDS
from neuron_moe.eval.tasks import evaluate, score_items
from neuron_moe.greedy import Generation
from neuron_moe.port import load_port
from neuron_moe.tokenizer import HFTokenizer, load_tokenizer
from neuron_moe.training.corpus import CorpusError, build_corpus, read_fortunes, read_jsonl
from neuron_moe.training.tiny import Windows, balance_loss, train

FORTUNES = [
    "A journey of a thousand miles begins with a single step.\n-- Lao Tzu",
    "Never put off till tomorrow what you can do the day after tomorrow.",
    "The _\bbest way to predict the future is to invent it.\n-- Alan Kay",
    "Simplicity is prerequisite for reliability.\n-- Edsger W. Dijkstra",
    "If you want to go fast, go alone. If you want to go far, go together.",
    "Time flies like an arrow; fruit flies like a banana.",
] * 4


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    text_dir = tmp_path_factory.mktemp("fortunes")
    for i in range(3):  # fortune files: '%'-separated, the format of the Debian package
        (text_dir / f"f{i}").write_text("\n%\n".join(f"{t} ({i}, {j})" for j, t in enumerate(FORTUNES)) + "\n%\n")
    (text_dir / "f0.dat").write_bytes(b"\x00\x01binary index")
    return text_dir


@pytest.fixture(scope="module")
def corpus(text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(text_dir, out, scale=0.02)
    return out


def test_fortunes_are_read_as_documents(text_dir, tmp_path):
    docs = read_fortunes(text_dir)
    assert len(docs) == 3 * len(FORTUNES)
    assert sum(d.startswith("The _best way to predict") for d in docs) == 12  # backspaces dropped
    with pytest.raises(CorpusError, match="no fortune files; install the Debian package: apt-get install fortunes"):
        read_fortunes(tmp_path)


def test_evaluation_items_are_never_training_items(corpus):
    train_text = "\n".join(r["text"] for r in read_jsonl(corpus / "train.jsonl"))
    evaluation = [T.Item(**r) for r in read_jsonl(corpus / "eval_tasks.jsonl")]
    assert {i.task for i in evaluation} == set(T.TASKS)
    for item in evaluation:
        assert item.prompt not in train_text, item
    # facts are held out by country: the question form of an evaluation country is never trained,
    # but its facts are stated in the training text
    validation = [T.Item(**r) for r in read_jsonl(corpus / "valid_tasks.jsonl")]
    assert {i.task for i in validation} == set(T.TASKS)
    for item in validation:
        assert item.prompt not in train_text, item
    assert not {i.prompt for i in validation} & {i.prompt for i in evaluation}
    split_of = T.COUNTRY_SPLIT
    held_out = [c for c, s in split_of.items() if s != "train"]
    for country in held_out:
        assert f"capital of {country}?" not in train_text and f"is {country} in?" not in train_text
    paragraphs = [r["text"] for r in read_jsonl(corpus / "train.jsonl") if r["kind"] == "fact_text"]
    stated = {c for c, capital, _ in T.FACTS if any(c in p and capital in p for p in paragraphs)}
    assert {c for c in held_out if split_of[c] == "eval"} & stated and {
        c for c in held_out if split_of[c] == "valid"
    } & stated
    kinds = {r["kind"] for r in read_jsonl(corpus / "train.jsonl")}
    assert kinds == {"text", "fact_text", *T.TASKS}


def test_fact_statements_state_both_facts_in_varied_words_never_as_the_question():
    rng = random.Random(0)
    forms = set()
    for _ in range(400):
        sentences = T.fact_sentences(rng, "Peru", "Lima", "South America")
        text = " ".join(sentences)
        assert "Lima" in text and "South America" in text, text
        assert "?" not in text and "Q:" not in text, text
        forms.update(s.replace("Lima", "*").replace("South America", "*") for s in sentences)
        assert all(
            s.startswith(("Peru", "The capital", "The continent", "In Peru"))
            for s in sentences
            if not s.startswith("Lima is the capital")
        ), sentences
    assert len(forms) >= 12, forms  # the fact in many wordings, so it must ride on the name


def test_every_continent_keeps_most_of_its_countries_in_the_training_questions():
    # the model learns to answer a continent from the training questions about it; a continent
    # mostly held out is never answered (a plain hash split once held out 6 of 7 South American
    # countries, and every held-out one was answered "Europe")
    by_continent = {}
    for country, _, continent in T.FACTS:
        by_continent.setdefault(continent, []).append(T.COUNTRY_SPLIT[country])
    assert len(by_continent) == 6 and len({c for c, _, _ in T.FACTS}) == len(T.FACTS)
    for continent, splits in by_continent.items():
        assert splits.count("train") >= (0.6 if len(splits) >= 5 else 0.5) * len(splits), continent
        if len(splits) >= 5:
            assert splits.count("eval") >= 1 and splits.count("valid") >= 1, continent
    assert T._country_splits(T.FACTS[::-1]) == T.COUNTRY_SPLIT  # fixed by the names, not their order


def test_series_answers_are_long_worked_steps():
    item = T.series_parts(295, 9, 3)
    assert item.answer == "\n3: 295+9=304\n2: 304+9=313\n1: 313+9=322"
    tok = load_tokenizer(load_port("tiny-gemma4-moe"))
    lengths = [len(tok.encode(i.answer)) - 1 for i in T.eval_items(10, tasks=("series",))]
    assert min(lengths) > 200


@pytest.mark.parametrize("share, task_tokens", [(1.0, 90), (0.5, 60)])
def test_windows_fill_with_task_items_up_to_their_share_then_text(share, task_tokens):
    tasks = [[7] * 30 for _ in range(10)]  # whole items of 30 tokens; text is token 5
    windows = Windows(tasks, [[5] * 1000], seq_len=100, rng=random.Random(0), task_share=share)
    for _ in range(3):
        w = windows.window()
        assert len(w) == 100 and w.count(7) == task_tokens and set(w[task_tokens:]) == {5}


def test_train_refuses_a_task_share_outside_0_1(corpus, tmp_path):
    with pytest.raises(UserError, match="task share 0"):
        train(_tiny_config(), corpus, tmp_path / "a", steps=1, task_share=0, progress=False)


def _tiny_config():
    config = copy.deepcopy(load_port("tiny-gemma4-moe").config)
    config.vocab_size = 320  # what a BPE on the small test corpus can fill
    return config


def test_training_reproduces_its_loss_curve_and_writes_a_loadable_checkpoint(corpus, tmp_path):
    kw = dict(steps=3, batch_size=1, seq_len=384, progress=False)
    a = train(_tiny_config(), corpus, tmp_path / "a", seed=7, **kw)
    b = train(_tiny_config(), corpus, tmp_path / "b", seed=7, **kw)
    c = train(_tiny_config(), corpus, tmp_path / "c", seed=8, **kw)
    assert [r["loss"] for r in a["log"]] == [r["loss"] for r in b["log"]]
    assert [r["loss"] for r in a["log"]] != [r["loss"] for r in c["log"]]  # the seed matters
    # the recipe trains on 2 threads: reproducible at that thread count too
    d, e = (train(_tiny_config(), corpus, tmp_path / n, seed=7, threads=2, **kw) for n in "de")
    assert [r["loss"] for r in d["log"]] == [r["loss"] for r in e["log"]]
    assert a["log"][-1]["loss"] < a["log"][0]["loss"]
    model = load_checkpoint(tmp_path / "a")  # the strict loader reads what training wrote
    ref = load_checkpoint(tmp_path / "b")
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(v, w), k
    tok = HFTokenizer(tmp_path / "a")
    ids = tok.encode("Q: Add 7 to 123, 15 times.")
    assert ids[0] == tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert tok.decode(ids) == "Q: Add 7 to 123, 15 times."
    digits = [tok.decode([i]) for i in tok.encode("12345")[1:]]
    assert digits == list("12345")  # one token per digit
    log = json.loads((tmp_path / "a" / "train_log.json").read_text())
    assert log["steps"] == 3 and len(log["log"]) == 3


def test_balance_loss_is_one_when_balanced_and_grows_when_collapsed():
    E, k, n = 16, 4, 64
    uniform = torch.full((n, E), 1 / E)
    spread = torch.stack([torch.arange(i, i + k) % E for i in range(0, n * k, k)])
    collapsed_p = torch.zeros(n, E)
    collapsed_p[:, :k] = 1 / k
    collapsed_i = torch.arange(k).repeat(n, 1)
    assert abs(float(balance_loss([uniform], [spread], E)) - 1.0) < 1e-6
    assert abs(float(balance_loss([collapsed_p], [collapsed_i], E)) - E / k) < 1e-6


class _Tok:
    """Whitespace 'tokenizer' over a fixed word list: enough to test the scoring."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2
    words = ["<pad>", "<eos>", "<bos>", "Q:", "A:", "x", "y", "z"]

    def encode(self, text):
        return [2] + [self.words.index(w) for w in text.split()]

    def decode(self, ids):
        return " " + " ".join(self.words[i] for i in ids if i > 2)


@pytest.mark.parametrize(
    "continuation,correct",
    [
        ([5, 6, 1, 7], True),  # the answer, EOS, then anything
        ([5, 6, 7, 1], False),  # an extra token before EOS
        ([5, 7, 1, 1], False),  # a wrong token
        ([5, 6, 6, 6], False),  # never stops (no EOS)
    ],
)
def test_scoring_is_exact_match_up_to_eos(continuation, correct):
    item = T.Item("reverse", "Q: y x A:", " x y")

    def generate(ids, mask, n):
        toks = torch.tensor([continuation[:n] + [1] * max(0, n - len(continuation))])
        return Generation(toks, torch.zeros(1, n, 8))

    rows = score_items(generate, _Tok(), [item])
    assert rows[0]["correct"] is correct and rows[0]["answer_tokens"] == 2


def test_committed_model_copies_and_recalls_held_out_facts():
    """The shipped checkpoint (not seeded random weights) reverses held-out lists, writes held-out
    15-18-line series exactly and recalls facts it read only as statements, asked in the Q/A form
    (bench/results/tiny-model.md: fact, reverse and series 50/50 each; chance on a capital is
    ~1/13). kv (22 %) it does not yet answer, so it has no bar here."""
    port = load_port("tiny-gemma4-moe")
    dense = BACKENDS["dense_masked"]
    fact = evaluate(port, dense, per_task=8, tasks=("fact",))["tasks"][0]
    assert fact["accuracy"] >= 7 / 8, fact
    reverse = evaluate(port, dense, per_task=8, tasks=("reverse",))["tasks"][0]
    series = evaluate(port, dense, per_task=1, tasks=("series",))["tasks"][0]  # 245 decode steps
    assert reverse["accuracy"] >= 7 / 8 and series["accuracy"] == 1, (reverse, series)


def test_eval_tasks_cli_reports_accuracy_perplexity_and_expert_load(corpus, tmp_path, capsys):
    out = tmp_path / "tasks.json"
    assert (
        cli.main(
            [
                "eval-tasks",
                "--items",
                "2",
                "--task",
                "fact",
                "--task",
                "reverse",
                "--corpus",
                str(corpus),
                "--text-docs",
                "3",
                "--backend",
                "dense_masked",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["task"] for r in report["tasks"]] == ["fact", "reverse"] and len(report["items"]) == 4
    text = report["text"]
    held_out = len(read_jsonl(corpus / "eval_text.jsonl"))
    assert held_out >= 1 and text["documents"] == min(3, held_out)
    assert text["perplexity"] > 1 and text["unigram_perplexity"] > 1
    share = torch.tensor(text["expert_share"])
    assert share.shape == (4, 16) and torch.allclose(share.sum(-1), torch.ones(4, dtype=share.dtype))
    printed = capsys.readouterr().out
    assert "unigram baseline" in printed and "expert share" in printed


def test_eval_tasks_on_the_validation_split_asks_its_items_and_reads_the_calibration_text(corpus, tmp_path):
    out = tmp_path / "valid.json"
    assert (
        cli.main(
            [
                "eval-tasks",
                "--split",
                "valid",
                "--items",
                "2",
                "--task",
                "fact",
                "--corpus",
                str(corpus),
                "--text-docs",
                "2",
                "--backend",
                "dense_masked",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    want = [T.Item(**r) for r in read_jsonl(corpus / "valid_tasks.jsonl") if r["task"] == "fact"][:2]
    assert report["split"] == "valid" and [r["prompt"] for r in report["items"]] == [i.prompt for i in want]
    for item in want:  # asked about a validation country
        country = next(c for c, _, _ in T.FACTS if f" {c}?" in item.prompt or f" {c} in?" in item.prompt)
        assert T.COUNTRY_SPLIT[country] == "valid", item
    calib_text = [r for r in read_jsonl(corpus / "calib.jsonl") if r["kind"] == "text"]
    assert report["text"]["documents"] == min(2, len(calib_text))

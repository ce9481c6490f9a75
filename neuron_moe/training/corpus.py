"""The training corpus of the tiny model: real English text plus the synthetic task mix.

Text: the fortune-cookie files of the Debian package `fortunes` (FORTUNES_PACKAGE, installed to
/usr/share/games/fortunes; `recipes/cpu/train-tiny.sh` installs it): quotations, jokes, poems
and definitions, ~2.5 MB of English. Each fortune is a document; a stable hash of its text puts
it in train (90 %), calibration (5 %) or evaluation (5 %).

Tasks (`neuron_moe.tasks`): training items are drawn from their own seed and exclude the
evaluation subjects and prompts; fact statements about every country are training text.

Output, a directory of JSON-lines files, one document per line ({"kind": ..., "text": ...}):
train.jsonl, calib.jsonl, eval_text.jsonl, eval_tasks.jsonl and valid_tasks.jsonl (the validation
split's items, for choosing between training runs) ({"task", "prompt", "answer"}).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

from ..errors import UserError
from .. import tasks as T
from ..report import atomic_write, write_json

FORTUNES_PACKAGE = "fortunes=1:1.99.1-7.3"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
# Not prose: ASCII pictures, and text in other languages.
SKIP_FILES = {"art", "ascii-art", "translate-me"}
# Training items per task (a `series` item is ~240 tokens, a `fact` question ~15). fact: ~280
# questions per training country; 32,000 taught the held-out countries' questions less well
# (bench/results/tiny-model.md, v10 and v11).
TRAIN_ITEMS = {"fact": 12000, "kv": 24000, "reverse": 32000, "series": 5000}
FACT_PARAGRAPHS = 12000  # statements of the facts about every country (held-out ones included); packed as items
EVAL_ITEMS_PER_TASK = 50


class CorpusError(UserError):
    pass


def read_fortunes(text_dir: Path) -> list[str]:
    """Every fortune in the directory's data files (`%`-separated), whitespace-normalised per line."""
    files = sorted(p for p in Path(text_dir).iterdir() if p.is_file() and p.suffix == "" and p.name not in SKIP_FILES)
    if not files:
        raise CorpusError(
            f"{text_dir}: no fortune files; install the Debian package: apt-get install {FORTUNES_PACKAGE}"
        )
    docs = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for chunk in text.split("\n%\n"):
            # ~100 lines use backspace overstriking ("_\bx") for emphasis; the backspaces are dropped
            # and the overstruck pair stays ("_x"): the committed model was trained on exactly this
            lines = [" ".join(line.replace("\b", "").split()) for line in chunk.strip("%\n").splitlines()]
            doc = "\n".join(lines).strip()
            if len(doc) >= 20:
                docs.append(doc)
    return docs


def split_of(doc: str) -> str:
    f = T.stable_fraction("text:" + doc)
    return "eval" if f < 0.05 else "calib" if f < 0.10 else "train"


def build_corpus(text_dir: Path, out_dir: Path, seed: int = 0, scale: float = 1.0) -> dict:
    """Write the corpus files; `scale` multiplies the number of training task items (tests use a
    small one). Returns the counts per file and kind."""
    docs = read_fortunes(text_dir)
    splits = {"train": [], "calib": [], "eval": []}
    for doc in dict.fromkeys(docs):  # duplicates (the same quote in two files) once, in one split
        splits[split_of(doc)].append({"kind": "text", "text": doc})

    evaluation = T.eval_items(EVAL_ITEMS_PER_TASK)
    calibration = T.eval_items(EVAL_ITEMS_PER_TASK, seed=4321)
    validation = T.eval_items(EVAL_ITEMS_PER_TASK, split="valid")
    held_out = {i.prompt for i in evaluation + validation}
    rng = random.Random(seed)
    train = splits["train"]
    for task, n in TRAIN_ITEMS.items():
        for _ in range(max(1, round(n * scale))):
            item = T.train_item(rng, task, held_out)
            train.append({"kind": task, "text": item.prompt + item.answer})
    for _ in range(max(1, round(FACT_PARAGRAPHS * scale))):
        train.append({"kind": "fact_text", "text": T.fact_text(rng)})
    rng.shuffle(train)
    calib = splits["calib"] + [{"kind": i.task, "text": i.prompt + i.answer} for i in calibration]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "train.jsonl": train,
        "calib.jsonl": calib,
        "eval_text.jsonl": splits["eval"],
        "eval_tasks.jsonl": [asdict(i) for i in evaluation],
        "valid_tasks.jsonl": [asdict(i) for i in validation],
    }
    for name, rows in files.items():
        with atomic_write(out_dir / name) as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    counts = {name: len(rows) for name, rows in files.items()}
    counts["train_kinds"] = {k: sum(r["kind"] == k for r in train) for k in dict.fromkeys(r["kind"] for r in train)}
    counts["source"] = {"text": f"Debian package {FORTUNES_PACKAGE}", "text_dir": str(text_dir), "seed": seed}
    write_json(counts, str(out_dir / "manifest.json"))
    return counts


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: missing; build the corpus first (neuron-moe build-corpus)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{n}: not JSON: {e}") from None
    return rows


def render_corpus(counts: dict, out) -> str:
    return f"corpus in {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if isinstance(v, int))

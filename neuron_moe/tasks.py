"""The task suite of the trained tiny model: items with exact answers, and their splits.

Four tasks, each a generator of (prompt, answer) items from a seeded `random.Random`:

  fact     recall of a fact stated in the training text, asked in a Q/A form that training never
           shows for that country ("Q: What is the capital of Peru?" -> "Lima")
  kv       key-value retrieval from earlier in the context
  reverse  reverse a list of words
  series   multi-digit arithmetic with worked steps: repeated addition, one line per step,
           lines counted down so that stopping is local; 15-18 lines, over 200 tokens

Evaluation items are never in training: `fact` and `series` split by subject (country; start
and step), the others exclude from training every prompt that the evaluation set holds. A
validation split, held out the same way with subjects of its own, is for choosing between
training runs, so that the evaluation split stays an estimate of the chosen one.
Training (`training/corpus.py`) and evaluation (`eval/tasks.py`, which scores a model on them)
both take their items from here.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

# (country, capital, continent): facts the training text states and the `fact` task asks about.
FACTS = (
    ("France", "Paris", "Europe"),
    ("Germany", "Berlin", "Europe"),
    ("Italy", "Rome", "Europe"),
    ("Spain", "Madrid", "Europe"),
    ("Portugal", "Lisbon", "Europe"),
    ("Greece", "Athens", "Europe"),
    ("Poland", "Warsaw", "Europe"),
    ("Austria", "Vienna", "Europe"),
    ("Norway", "Oslo", "Europe"),
    ("Sweden", "Stockholm", "Europe"),
    ("Finland", "Helsinki", "Europe"),
    ("Denmark", "Copenhagen", "Europe"),
    ("Ireland", "Dublin", "Europe"),
    ("Hungary", "Budapest", "Europe"),
    ("Belgium", "Brussels", "Europe"),
    ("Netherlands", "Amsterdam", "Europe"),
    ("Russia", "Moscow", "Europe"),
    ("Ukraine", "Kyiv", "Europe"),
    ("Romania", "Bucharest", "Europe"),
    ("Bulgaria", "Sofia", "Europe"),
    ("Serbia", "Belgrade", "Europe"),
    ("Croatia", "Zagreb", "Europe"),
    ("Iceland", "Reykjavik", "Europe"),
    ("Switzerland", "Bern", "Europe"),
    ("Japan", "Tokyo", "Asia"),
    ("China", "Beijing", "Asia"),
    ("India", "New Delhi", "Asia"),
    ("Thailand", "Bangkok", "Asia"),
    ("Vietnam", "Hanoi", "Asia"),
    ("Indonesia", "Jakarta", "Asia"),
    ("Philippines", "Manila", "Asia"),
    ("Malaysia", "Kuala Lumpur", "Asia"),
    ("Iran", "Tehran", "Asia"),
    ("Iraq", "Baghdad", "Asia"),
    ("Pakistan", "Islamabad", "Asia"),
    ("Nepal", "Kathmandu", "Asia"),
    ("Mongolia", "Ulaanbaatar", "Asia"),
    ("Bangladesh", "Dhaka", "Asia"),
    ("Turkey", "Ankara", "Asia"),
    ("Egypt", "Cairo", "Africa"),
    ("Kenya", "Nairobi", "Africa"),
    ("Nigeria", "Abuja", "Africa"),
    ("Ethiopia", "Addis Ababa", "Africa"),
    ("Ghana", "Accra", "Africa"),
    ("Morocco", "Rabat", "Africa"),
    ("Senegal", "Dakar", "Africa"),
    ("Uganda", "Kampala", "Africa"),
    ("Tanzania", "Dodoma", "Africa"),
    ("Algeria", "Algiers", "Africa"),
    ("Tunisia", "Tunis", "Africa"),
    ("Sudan", "Khartoum", "Africa"),
    ("Canada", "Ottawa", "North America"),
    ("Mexico", "Mexico City", "North America"),
    ("Cuba", "Havana", "North America"),
    ("Jamaica", "Kingston", "North America"),
    ("Brazil", "Brasilia", "South America"),
    ("Argentina", "Buenos Aires", "South America"),
    ("Peru", "Lima", "South America"),
    ("Chile", "Santiago", "South America"),
    ("Colombia", "Bogota", "South America"),
    ("Venezuela", "Caracas", "South America"),
    ("Ecuador", "Quito", "South America"),
    ("Australia", "Canberra", "Oceania"),
    ("New Zealand", "Wellington", "Oceania"),
)
WORDS = (
    "ant bee cat dog elk fox gnu hen owl pig rat yak cow emu ape bat eel jay kid "
    "ram red blue green gold pink gray black white tea cup pen box hat map key sun "
    "moon star rain snow wind tree leaf rock sand lake hill road door"
).split()
TASKS = ("fact", "kv", "reverse", "series")


@dataclass(frozen=True)
class Item:
    task: str
    prompt: str  # ends where the model's answer begins
    answer: str  # what the model must produce (then EOS)


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone (sha1), for splits that do not move between runs."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2**64


SPLITS = ("eval", "valid")


def _split_at(f: float) -> str:
    return "eval" if f < 0.2 else "valid" if f < 0.35 else "train"


def subject_split(key: str) -> str:
    """Which split a series' (start, step) belongs to: eval, valid or train."""
    return _split_at(stable_fraction(key))


def _country_splits(facts) -> dict[str, str]:
    # Stratified by continent: within each, countries are ranked by their stable hash and the
    # rank's quantile picks the split, so every continent of five or more countries keeps ~65 %
    # of them in the training questions. (A plain hash split held out 6 of 7 South American countries, and the
    # model answered "Europe", or nothing, for held-out ones.)
    by_continent: dict[str, list[str]] = {}
    for country, _, continent in facts:
        by_continent.setdefault(continent, []).append(country)
    splits = {}
    for countries in by_continent.values():
        ranked = sorted(countries, key=stable_fraction)
        for rank, country in enumerate(ranked):
            splits[country] = _split_at((rank + 0.5) / len(ranked))
    return splits


COUNTRY_SPLIT = _country_splits(FACTS)


def fact_sentences(rng: random.Random, country: str, capital: str, continent: str) -> list[str]:
    """The facts as training text states them (for every country, in either order). All wordings but
    one put the country before the fact, each in different words, so that only the country's name
    predicts the fact: the model has to carry it on the name, which is where a held-out country's
    question finds it. (With 3 + 2 fixed wordings, held-out fact recall was 70-80 %; with these
    13, 96-100 %: bench/results/tiny-model.md, v11 and v12.)"""
    capital_forms = [
        f"The capital of {country} is {capital}.",
        f"The capital city of {country} is {capital}.",
        f"{country} has its capital in {capital}.",
        f"{country}'s capital is {capital}.",
        f"In {country}, the capital is {capital}.",
        f"{country} is governed from {capital}.",
        f"{capital} is the capital of {country}.",
    ]
    continent_forms = [
        f"{country} is a country in {continent}.",
        f"{country} is in {continent}.",
        f"{country} lies in {continent}.",
        f"{country} is part of {continent}.",
        f"The continent of {country} is {continent}.",
        f"{country} is on the continent of {continent}.",
    ]
    if rng.random() < 0.2:
        return [f"{country}, a country in {continent}, has its capital in {capital}."]
    sentences = [rng.choice(capital_forms), rng.choice(continent_forms)]
    if rng.random() < 0.5:
        sentences.reverse()
    return sentences


def fact_item(rng: random.Random, country: str, capital: str, continent: str) -> Item:
    if rng.random() < 0.5:
        return Item("fact", f"Q: What is the capital of {country}?\nA:", f" {capital}")
    return Item("fact", f"Q: Which continent is {country} in?\nA:", f" {continent}")


def kv_item(rng: random.Random) -> Item:
    keys = rng.sample(WORDS, rng.randint(4, 8))
    pairs = {k: rng.randint(10, 99) for k in keys}
    key = rng.choice(keys)
    listing = " ".join(f"{k}={v}" for k, v in pairs.items())
    return Item("kv", f"Q: {listing}. What is {key}?\nA:", f" {pairs[key]}")


def reverse_item(rng: random.Random) -> Item:
    words = rng.sample(WORDS, rng.randint(3, 8))
    return Item("reverse", f"Q: Reverse: {' '.join(words)}\nA:", " " + " ".join(reversed(words)))


def series_parts(start: int, step: int, lines: int) -> Item:
    out, value = [], start
    for n in range(lines, 0, -1):  # counted down, so when to stop is local: after line 1
        out.append(f"{n}: {value}+{step}={value + step}")
        value += step
    return Item("series", f"Q: Add {step} to {start}, {lines} times.\nA:", "\n" + "\n".join(out))


def series_item(rng: random.Random, split: str) -> Item:
    """A series whose (start, step) lies in `split`."""
    while True:
        start, step = rng.randint(100, 299), rng.randint(2, 9)
        if subject_split(f"series:{start}:{step}") == split:
            return series_parts(start, step, rng.randint(15, 18))


_RANDOM_ITEMS = {"kv": kv_item, "reverse": reverse_item}


SPLIT_SEEDS = {"eval": 1234, "valid": 5678}


def eval_items(per_task: int, seed: int | None = None, tasks=TASKS, split: str = "eval") -> list[Item]:
    """The fixed held-out set of `split` (eval or valid): `per_task` items of each task, subjects
    from that split; `seed` defaults to the split's own."""
    rng = random.Random(SPLIT_SEEDS[split] if seed is None else seed)
    items = []
    for task in tasks:
        for _ in range(per_task):
            if task == "fact":
                items.append(fact_item(rng, *rng.choice([f for f in FACTS if COUNTRY_SPLIT[f[0]] == split])))
            elif task == "series":
                items.append(series_item(rng, split))
            else:
                items.append(_RANDOM_ITEMS[task](rng))
    return items


def train_item(rng: random.Random, task: str, held_out: set[str]) -> Item:
    """One training item of `task`: never a held-out subject, never a held-out prompt."""
    while True:
        if task == "fact":
            item = fact_item(rng, *rng.choice([f for f in FACTS if COUNTRY_SPLIT[f[0]] == "train"]))
        elif task == "series":
            item = series_item(rng, "train")
        else:
            item = _RANDOM_ITEMS[task](rng)
        if item.prompt not in held_out:
            return item


def fact_text(rng: random.Random) -> str:
    """A training paragraph of fact statements, about any country (eval ones included)."""
    chosen = rng.sample(FACTS, rng.randint(2, 5))
    return " ".join(s for f in chosen for s in fact_sentences(rng, *f))

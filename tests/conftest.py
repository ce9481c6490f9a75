import dataclasses

import pytest
import torch

from neuron_moe.model import build_model
from neuron_moe.port import load_port


@pytest.fixture(scope="session")
def tiny_port():
    return load_port("tiny-gemma4-moe")


@pytest.fixture(scope="session")
def tiny_eager(tiny_port):
    return build_model(tiny_port, "eager", torch.float32)


def reseeded(port, seed):
    """The same architecture with seeded random weights instead of the port's trained checkpoint."""
    return dataclasses.replace(port, weights_source="random", seed=seed, checkpoint=None)


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in lengths]

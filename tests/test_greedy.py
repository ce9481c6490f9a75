import torch

from neuron_moe.greedy import greedy, left_pad

from conftest import random_prompts


def test_left_padding_does_not_change_a_row(tiny_eager):
    """A prompt generates the same tokens alone and padded inside a batch (positions skip pads)."""
    prompts = random_prompts(tiny_eager.config.vocab_size, [30, 6], seed=11)
    ids, mask = left_pad(prompts, pad_id=0)
    assert mask[1].tolist() == [0] * 24 + [1] * 6
    batch = greedy(tiny_eager, ids, mask, 20)
    alone = greedy(tiny_eager, *left_pad(prompts[1:], pad_id=0), 20)
    assert torch.equal(batch.tokens[1], alone.tokens[0])  # exact: the picks
    # The logits differ in fp32 summation order only: a batch of 2 rows and a 30-token prefill run other
    # GEMM kernels than 1 row and 6 tokens (a decode step of one row is a matrix-vector product), at any
    # thread count. Measured: 3.8 ulp (float32 eps) of the largest logit; a bug that lets the pads in moves
    # logits by whole units.
    bound = 16 * torch.finfo(torch.float32).eps * alone.logits[0].abs().max()
    assert (batch.logits[1] - alone.logits[0]).abs().max() <= bound


def test_greedy_picks_the_argmax_of_its_logits(tiny_eager):
    ids, mask = left_pad(random_prompts(tiny_eager.config.vocab_size, [9], seed=5), pad_id=0)
    out = greedy(tiny_eager, ids, mask, 8)
    assert out.tokens.shape == (1, 8) and out.logits.shape == (1, 8, tiny_eager.config.vocab_size)
    assert torch.equal(out.logits.argmax(-1), out.tokens)
    # the next step's logits are those of the sequence extended by the picked token
    full = torch.cat([ids, out.tokens[:, :-1]], dim=1)
    with torch.no_grad():
        tf = tiny_eager(full).logits[:, ids.shape[1] - 1 :].float()
    assert (tf - out.logits).abs().max() <= 5e-5  # fp32 cached vs uncached attention: ~2e-5 on the trained weights

"""`neuron-moe train-assistant`: Gemma-4's MTP assistant for a trained target, by teacher forcing.

The assistant is transformers' `Gemma4AssistantForCausalLM` (as Google's for Gemma-4: 4 layers that
read the target's KV and keep none of their own, `static/draft.py`), its text config small and its
attention geometry the target's: the head dims, KV-head counts, window and rotary embeddings of the
target's sliding and full-attention layers, whose KV its layers of each type attend over.
"""

from __future__ import annotations

import copy

from transformers import Gemma4AssistantConfig, Gemma4TextConfig

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

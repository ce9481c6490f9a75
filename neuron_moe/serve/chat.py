"""Chat messages -> prompt token ids.

With a tokenizer that has a chat template (an HF tokenizer saved with one), the template
renders the conversation and opens the assistant's turn. A tokenizer without one (the byte
tokenizer of the seeded ports) gets this plain fallback, documented in docs/serving.md:

    System: {content}\n\nUser: {content}\n\nAssistant: {content}\n\n ... Assistant:

and the assistant's turn then also ends at FALLBACK_STOP, so a model that goes on to write
the user's next line is cut there.
"""

from __future__ import annotations

FALLBACK_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
FALLBACK_STOP = "\n\nUser:"


def render_chat(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], tuple[str, ...]]:
    """[{"role", "content"}] -> (prompt ids, extra stop strings the template implies).
    OpenAI's newer "developer" role is the "system" role of chat templates."""
    messages = [dict(m, role="system" if m["role"] == "developer" else m["role"]) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages), ()
    turns = [f"{FALLBACK_ROLES[m['role']]}: {m['content']}\n\n" for m in messages]
    return tokenizer.encode("".join(turns) + "Assistant:"), (FALLBACK_STOP,)

"""The Triton reader's kernel variants by name: what bench/gpu_reader.py times beside the default and
bench/gpu_decode.py can run inside the model. Each gives the same output (the tests check it).

- "bisect": the default, `forward.forward` (eight launches, the select kernel's bisection);
- a select variant of `forward.SELECT_VARIANTS` (radix search, one-scan placement);
- "fused": `forward(fuse=True)`, six launches; "relaxed": `forward(atomics="relaxed")`;
- a `persistent.PERSISTENT_VARIANTS` name: the whole reader in one launch, in that tile shape.
"""

from __future__ import annotations

import functools

from ...errors import UserError
from . import forward, persistent

DEFAULT = "bisect"
FUSED, RELAXED = "fused", "relaxed"
SELECTS = [v for v in forward.SELECT_VARIANTS if v != DEFAULT]  # the select kernel's, beside its default
NAMES = [*SELECTS, FUSED, RELAXED, *persistent.PERSISTENT_VARIANTS]  # every variant beside the default


def reader_forward(name: str):
    """The forward (`forward.forward`'s signature) of a variant name, DEFAULT included."""
    if name in persistent.PERSISTENT_VARIANTS:
        return functools.partial(persistent.forward, shape=persistent.tiles(name))
    if name in (FUSED, RELAXED):
        return functools.partial(forward.forward, **({"fuse": True} if name == FUSED else {"atomics": "relaxed"}))
    if name == DEFAULT or name in SELECTS:
        return functools.partial(forward.forward, select_variant=name)
    raise UserError(f"unknown reader variant {name!r}; known: {DEFAULT}, {', '.join(NAMES)}")

"""The routed experts' geometry: the one description of their sizes, whole or one rank's share.

The sidecar's shapes (`sidecar.SidecarLayout`), the accounting of reads (`accounting.py`), the
per-rank shards (`shard.py`, `accounting.rank_geometry`: I/t channels of every expert) and the
kernels' plans all take their sizes from a `Geometry`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """`experts` experts of `intermediate` channels each over `hidden`; a token routes to `top_k`.

    Keywords only: the orders (hidden, experts, top_k, intermediate) and (hidden, experts,
    intermediate) were both in use, and two swapped sizes would run without an error.
    """

    hidden: int
    experts: int
    # The model's routing, not a property of the weights: a sidecar does not record it (None there).
    # (Before intermediate, as the accounting's reports have always listed the fields.)
    top_k: int | None = None
    intermediate: int  # channels per expert: the whole model's I, or one rank's I/t

    @classmethod
    def from_config(cls, config) -> "Geometry":
        return cls(
            hidden=config.hidden_size,
            experts=config.num_experts,
            intermediate=config.moe_intermediate_size,
            top_k=config.top_k_experts,
        )

    @classmethod
    def explicit(cls, hidden: int | None, experts: int | None, top_k: int | None, intermediate: int | None):
        """`reads`' explicit geometry (--hidden --experts --top-k --intermediate): all four, or None for
        none given; anything between is a UserError naming what is missing or wrong."""
        given = (hidden, experts, top_k, intermediate)
        if all(v is None for v in given):
            return None
        if None in given:
            raise UserError("an explicit geometry needs all four of --hidden --experts --top-k --intermediate")
        if top_k > experts:
            raise UserError(
                f"--top-k {top_k} is more than --experts {experts}: a token routes to at most every expert once"
            )
        return cls(hidden=hidden, experts=experts, top_k=top_k, intermediate=intermediate)

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(hidden, experts, intermediate): what the expert weights' shapes follow from, whatever the routing."""
        return self.hidden, self.experts, self.intermediate

    @property
    def channels(self) -> int:
        """Channels a token's experts hold: the candidates of one selection."""
        if self.top_k is None:
            raise ValueError("a geometry without top_k (a sidecar's) has no channels per token")
        return self.top_k * self.intermediate

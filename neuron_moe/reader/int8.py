"""The reader over int8 experts: the exact channels read as int8 rows with their scales.

The numbers are `experts/int8.py`'s (the TP channel layout's): one symmetric scale per gate/up
row, per (expert, output channel), and for the down one per (expert, hidden channel). What this
module fixes is how the reader holds them, so that a channel is contiguous reads:

  gate_up        int8 [E, 2I, H]  row j the gate row of channel j, row I + j its up row (HF's order)
  gate_up_scale  fp32 [E, I, 2]   channel j's (gate, up) scales side by side: 8 bytes, one sector
  down           int8 [E, I, H]   row j channel j's down weights (the reader's row layout)
  down_scale     fp32 [E, H]      one per hidden channel, read once per routed expert

A channel's exact read is then three int8 rows and one scale pair (accounting.channel_bytes); the
sketch, the norms and the recovery map are the bf16 sidecar's, made from the bf16 weights the int8
ones were quantised from or from the dequantised int8 (`dequantized`; eval measures which is better).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Int8Experts:
    gate_up: torch.Tensor  # int8 [E, 2I, H]
    gate_up_scale: torch.Tensor  # fp32 [E, I, 2]
    down: torch.Tensor  # int8 [E, I, H]
    down_scale: torch.Tensor  # fp32 [E, H]

    @classmethod
    def from_channel_layout(cls, gate_up_q, gate_up_scale, down_q, down_scale) -> "Int8Experts":
        """From `experts/int8.py`'s tensors: gate_up [E, H, 2I] with scale [E, 1, 2I], down [E, I, H]
        with scale [E, 1, H] (the same numbers, rearranged into rows)."""
        E, _, rows = gate_up_scale.shape
        pairs = gate_up_scale.reshape(E, 2, rows // 2).transpose(1, 2).contiguous()
        return cls(gate_up_q.mT.contiguous(), pairs, down_q.contiguous(), down_scale[:, 0].contiguous())

    def rows(self, expert: torch.Tensor, channel: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Channels (expert, channel) of any shape [...] -> their gate, up and down rows dequantised, fp32 [..., H]."""
        inter = self.down.shape[1]
        scale = self.gate_up_scale[expert, channel]  # [..., 2]
        gate = self.gate_up[expert, channel].to(torch.float32) * scale[..., :1]
        up = self.gate_up[expert, channel + inter].to(torch.float32) * scale[..., 1:]
        down = self.down[expert, channel].to(torch.float32) * self.down_scale[expert]
        return gate, up, down

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights the int8 numbers stand for, in HF's layout: gate_up [E, 2I, H], down [E, H, I], fp32."""
        scale = torch.cat([self.gate_up_scale[..., 0], self.gate_up_scale[..., 1]], dim=1)  # [E, 2I]
        gate_up = self.gate_up.to(torch.float32) * scale[..., None]
        down = self.down.to(torch.float32) * self.down_scale[:, None, :]  # [E, I, H]
        return gate_up, down.mT

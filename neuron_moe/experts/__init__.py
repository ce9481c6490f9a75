"""Our experts implementations, registered with transformers' experts-implementation registry.

Importing this package is enough: afterwards `model.set_experts_implementation("dense_masked")`
or `from_pretrained(..., experts_implementation="dense_masked")` replaces only each layer's
`self.experts` forward; HF's router and dual-path decoder layer run unchanged.
"""

from transformers.integrations.moe import ExpertsInterface

from .channel_reader import channel_reader_forward
from .dense_masked import dense_masked_forward
from .int8 import int8_forward
from .selective import selective_forward
from .selector_experts import selector_forward

IMPLEMENTATIONS = {
    "dense_masked": dense_masked_forward,
    "selective": selective_forward,
    "int8": int8_forward,
    "channel_reader": channel_reader_forward,  # needs a sidecar: channel_reader.attach_reader
    "selector": selector_forward,  # a reader/selectors.py baseline: selector.attach_selector
}

for _name, _fn in IMPLEMENTATIONS.items():
    ExpertsInterface.register(_name, _fn)

# "eager" is HF's own loop: the CPU reference every other implementation is checked against.
ALL = ("eager", *IMPLEMENTATIONS)

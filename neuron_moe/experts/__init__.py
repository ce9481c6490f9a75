"""Our experts implementations, registered with transformers' experts-implementation registry.

Importing this package is enough: afterwards `spec.set_experts(model, spec.DENSE_MASKED)` or
`from_pretrained(..., experts_implementation="dense_masked")` replaces only each layer's
`self.experts` forward; HF's router and dual-path decoder layer run unchanged.
"""

from transformers.integrations.moe import ExpertsInterface

from .. import spec
from .channel_reader import channel_reader_forward
from .dense_masked import dense_masked_forward
from .selective import selective_forward
from .selector_experts import selector_forward

# The HF forward of every entry of spec.EXPERTS, one each; None: HF's own loop (the CPU reference).
FORWARDS = {
    spec.EAGER: None,
    spec.DENSE_MASKED: dense_masked_forward,
    spec.SELECTIVE: selective_forward,
    spec.CHANNEL_READER: channel_reader_forward,  # needs a sidecar: channel_reader.attach_reader
    spec.SELECTOR: selector_forward,  # a reader/selectors.py baseline: selector_experts.attach_selector
}

for _experts, _forward in FORWARDS.items():
    if _forward is not None:
        ExpertsInterface.register(_experts.name, _forward)

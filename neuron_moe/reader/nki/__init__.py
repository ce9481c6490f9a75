"""NKI (NeuronCore-v2, inf2) kernels of the reader. `plan.py` and `forward.py` import no Neuron
SDK; `kernels.py` needs `nki` and is imported only when the nki backend runs. Not run on
hardware: see README."""

"""Tensor parallelism: who owns what (layout), the parallel layers on gloo (cpu) and on
neuronx-distributed (nxd), the rank modules written once over either, and trace-once-replicate."""

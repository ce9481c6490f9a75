"""neuron-moe: Gemma-4 MoE on AWS Inferentia2, with a CPU reference and a sparse-channel reader."""

__version__ = "0.1.0"

"""Inferentia2: the memory planner (plan.py) and, with the Neuron SDK, tracing and compiling."""

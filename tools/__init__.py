"""Maintenance tools: each module runs from the repository root as `python -m tools.NAME`. They
check the package against the world (NxD's source) or write the package data that a measurement
outside the test suite establishes (the XLA op allow-list)."""

"""Benchmarks: each module runs from the repository root as `python -m bench.NAME` and prints a
table (and writes JSON where asked). They measure; the test suite checks. Recorded results, with
the command that made each, are in bench/results/.
"""

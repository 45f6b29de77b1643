"""The benchmarks and the GPU check: they write the figures of bench/results/results.json.

Run from the repository root as modules: `python -m bench.benchmark`."""

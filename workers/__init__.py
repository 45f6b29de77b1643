"""Programs started under torchrun by the tests, the benchmarks and the notebooks: each rank runs
one. From the repository root: `torchrun --standalone --nproc-per-node=2 -m workers.NAME ...`."""

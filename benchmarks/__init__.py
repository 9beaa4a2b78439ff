"""Benchmark suite of torchrl_dcp: ``python -m benchmarks.run`` (see ``benchmarks/README.md``)."""

"""Benchmarks (need CUDA): CUDA-graph replay, median, against eager and default Inductor."""

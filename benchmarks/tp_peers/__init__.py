"""One module per engine of ``benchmarks/tensor_parallel.py`` (``run(case) -> result``)."""

"""One module per engine of ``benchmarks/expert_parallel.py`` (``run(case) -> result``)."""

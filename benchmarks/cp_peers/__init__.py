"""The engines of ``benchmarks/context_parallel.py`` (one module each) and what they share."""

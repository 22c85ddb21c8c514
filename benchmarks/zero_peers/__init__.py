"""One runner per framework for ``benchmarks/zero.py``; each has ``run(case) -> dict``."""

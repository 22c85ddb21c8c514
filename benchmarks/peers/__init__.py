"""One module per framework benchmarked by ``benchmarks/pipeline.py``.

Each has ``run(case) -> dict``, executed on every rank of a job started by that
framework's launcher; rank 0's result is the job's result.
"""

"""Command-line tools over the library: the benchmark (``bench``), the demo (``demo``), the seeded fuzzer (``fuzz``)
and the synthetic paged batches they and the tests share (``workloads``).
"""

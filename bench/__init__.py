"""Benchmarks and quality measurements (not part of the installed packages, not part of the timed tests).

Run each one as a module from the repository root, e.g. ``python -m bench.serve_bench``; ``--quick`` is a
smoke run of a minute or less that writes into a temporary folder (``--out`` to choose one), and
``tests/bench/test_bench_quick.py`` runs every bench that way. Shared helpers live in ``bench.common``.
"""

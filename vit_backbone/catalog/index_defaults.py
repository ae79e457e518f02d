"""Defaults of the similarity index shared by the library (``catalog.index``) and the command line
(``catalog.index_cli``, which must not import numpy or LanceDB to print its help)."""

DEFAULT_ANN_THRESHOLD = 100_000  # rows from which a table gets an IVF-PQ index; below it search is exact

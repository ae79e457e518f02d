"""vitembed: the adapters around the pure ``vit_backbone`` library: the ``vitembed`` command line
(``vitembed.cli``), the HTTP server (``vitembed.server``) and the serving engine it drives
(``vitembed.engine``: batching, admission, served heads and indexes).

Kept import-free on purpose: ``vitembed --help`` and ``vitembed inspect`` must not pay for (or require) the
web framework, which the ``serve`` subcommand imports lazily.
"""

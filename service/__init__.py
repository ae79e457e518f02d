"""service: the adapters around the pure ``vit_backbone`` library: the ``vitembed`` command line and the HTTP
server.

Kept import-free on purpose: ``vitembed --help`` and ``vitembed inspect`` must not pay for (or require) the
web framework, which the ``serve`` subcommand imports lazily.
"""

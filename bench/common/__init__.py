"""Helpers shared by the benches, one concept per module:

- ``images``: test JPEGs (scikit-image's bundled photos resized like a user's catalog; noise, the worst case
  for entropy decoding);
- ``machine``: CPU accounting per process (``CpuWindow``), waiting for a quiet machine, the bench lock,
  machine facts, RSS;
- ``loadgen``: an HTTP load generator in its own process (closed- or open-loop), reporting its own CPU time;
- ``server``: ``vitembed serve`` as a subprocess on loopback, its /metrics;
- ``report``: results → ``<name>.json`` + ``<name>.md``, the ``--quick`` / ``--out`` options, formatting.
"""

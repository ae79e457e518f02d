"""The ``vitembed`` command line: one module per subcommand; ``main`` parses and dispatches."""

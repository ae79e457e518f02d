"""``python -m vitembed``: the same as the ``vitembed`` command."""

from vitembed.cli.main import main

raise SystemExit(main())

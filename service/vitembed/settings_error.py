"""``SettingsError``: a setting or start-up check the server cannot run with (exit status 2, one line).

Its own module, free of heavy imports, so that the command line (``cli/serve.py``) and the start-up checks
of the served indexes (``engine/served_indexes.py``) share it without importing each other."""


class SettingsError(ValueError):
    pass

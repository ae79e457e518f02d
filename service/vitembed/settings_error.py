"""``SettingsError``: a setting or start-up check the server cannot run with (exit status 2, one line).

Its own module, free of heavy imports, so that the command line (``serve_cmd``) and the routers that check
their configuration at start-up (``routes_search``) share it without importing each other."""


class SettingsError(ValueError):
    pass

"""The HTTP adapter: the FastAPI app, its routes, request parsing, serialisation and the one error boundary.
No model logic: requests go to ``vitembed.engine``."""

"""A protocol-faithful fake SGLang HTTP server for tests (see server.py) and tiny-model helpers."""

"""The local stack: the rendered engine and router containers as processes on 127.0.0.1."""

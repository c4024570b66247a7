"""Traces: the spans of a client request and of each upstream request, and the trace
context the legs carry (`spans.py`); the TracerProvider, who decides sampling and the
bound on a span's strings (`sampling.py`); spans as JSON lines (`spanfile.py`).

Imports the router's leaf modules (`codec`, `config`) only; never `request`, `store`,
`pool`, `engine`, `datapath` or `server`.
"""

"""The engine client: how the router talks to prefill and decode engines. One connection
and its exchange (`connection.py`), the legs' HTTP/1.1 pool (`http.py`), the clients and
the one resend a stale kept-alive connection gets (`clients.py`), what goes upstream
(`bodies.py`), decode's stream with its handle taken out (`sse.py`), and how an exchange
fails and what the client is told (`failures.py`).

Imports `tracing`, `pool`, `request` and the leaf modules; never `datapath` or `server`.
"""

"""Decode handles kept per conversation: the in-process store and the shared store
(Valkey/Redis), behind one async interface (`base.Store`).

Imports the router's leaf modules (`codec`, `config`) only; never `request`, `pool`,
`datapath` or `server`.
"""

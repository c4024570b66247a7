"""Decode handles kept per conversation: the rules and the record (`base.py`), the
in-process store (`memory.py`) and the shared store (`shared.py`, its Lua in
`scripts.py`), behind one async interface (`base.Store`).

Imports the router's leaf modules (`codec`, `config`) only; never `request`, `pool`,
`engine`, `datapath` or `server`.
"""

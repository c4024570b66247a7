"""What a client sends, read before anything is forwarded: body limits, request
checks with OpenAI-style errors, the tenant and the conversation's lookup keys; and the
router's own JSON answers (`replies.py`).

Imports the router's leaf modules only; never `store`, `pool`, `engine`, `datapath` or
`server`.
"""

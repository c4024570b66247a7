"""Keys of `kv_transfer_params` that the router writes and the engine plugin reads: each
named once, here, owned by neither side (as bidirkv/proof.py is).

    bidirkv_proof   the router's single-use proof (bidirkv/proof.py), on both legs
    bidirkv_owner   who decode keeps the retained blocks for (decode leg)
    bidirkv_tenant  a label of the request's tenant, for fair reclaiming on decode
                    (hex of the router's keyed tenant hash, never a credential)
"""

PROOF_KEY = "bidirkv_proof"
OWNER_KEY = "bidirkv_owner"
TENANT_KEY = "bidirkv_tenant"
# Decode keeps at most this much of a tenant label: a direct caller cannot grow its
# memory with it; the router sends TENANT_LABEL_LEN.
MAX_TENANT_LEN = 64
TENANT_LABEL_LEN = 32

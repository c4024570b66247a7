"""Pure rendering: a DisaggregatedInference -> the child objects the operator owns.

Owns names, labels, pod templates, Services, NetworkPolicies and the handle-key
Secret. No I/O: it imports the API models and the shared role config, never `kube`,
`reconcile` or `crd`.
"""

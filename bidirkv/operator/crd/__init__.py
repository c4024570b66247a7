"""The CRD: its schema generated from the API models, and `bidir-kv crd --apply`.

Imports the API models (and `kube` for applying); never `render` or `reconcile`.
"""

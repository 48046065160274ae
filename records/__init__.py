"""The host record: what this host learned about thread counts, in one SQLite file (R4.9).

Knows nothing of torch or HTTP: it stores strings, numbers and JSON for scopes
(host fingerprint, artifact revision, backend).
"""

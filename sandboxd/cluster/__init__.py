"""Several hosts (docs/scale.md): the directory in etcd, the per-call check, fencing, and the certificates' roles.

records.py (the records and the check, no I/O), directory.py (the etcd client), view.py (the watch-fed copy),
membership.py (a host's lease and fencing); tls.py, roles.py and dial.py for the mutual-TLS side.
"""

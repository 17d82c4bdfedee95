"""Several hosts: etcd, certificates and daemons started by the tests (issue 46)."""

"""The fixtures of tests/cluster: a test etcd, several daemons pointed at it, the e2e harness's Docker check."""

from tests.cluster.etcd import etcd
from tests.cluster.hosts import make_hosts
from tests.e2e.conftest import docker_api

__all__ = ["docker_api", "etcd", "make_hosts"]

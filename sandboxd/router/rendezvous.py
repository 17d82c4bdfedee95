"""Rendezvous placement lives in cluster/rendezvous.py: a draining host's daemon and the operator's drain need it too."""

from sandboxd.cluster.rendezvous import place, weight

__all__ = ["place", "weight"]

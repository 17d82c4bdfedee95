"""The egress rules, decided without I/O: which addresses are public, what the allow-list lets
through, where the browser relay is, which hosts a secret's value may go to.

Below config (it validates its egress keys with them) and below egress (the proxy applies them).
"""

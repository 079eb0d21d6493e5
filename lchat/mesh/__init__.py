"""The mesh (docs/design.md §9): several boxes, one bucket, no coordinator.

``membership`` (heartbeats in the bucket), ``placement`` (rendezvous hashing), ``forward`` (the
authenticated one-hop marker and the peer target), ``api`` (route replication between boxes).
"""

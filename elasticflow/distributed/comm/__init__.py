"""Collectives: one generation's gloo group and its sums (comm.py), the hierarchical sum through each group's
leader (hierarchy.py), which address a host binds and advertises (netif.py), and what an NCCL error does: it
raises into the recovery instead of ending the process (nccl.py).

May import distributed/protocol.py (``CommError``); no other room. It knows nothing of models or of membership:
a group is handed its store, rank and world.
"""

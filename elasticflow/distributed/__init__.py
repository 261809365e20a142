"""Elastic data parallelism, in four rooms over one shared contract (lowest first; a room imports only the rooms
below it, and its own):

    protocol.py   what the agent and the workers say to each other: store keys, exit codes, the job token, sealed
                  records, the store inbox (imports no room)
    store/        the job's store: the private and token servers, their wire, etcd, picking one and connecting
    comm/         collectives: a generation's gloo group and its sums, the hierarchical sum, which address to bind
    membership/   a worker's side: joining, heartbeats, following generations (rendezvous: when one formed)
    agent/        the agent (job master) and the parts it owns, the node agents of other hosts, and `scale`'s client

tests/test_imports.py (``ROOMS``) keeps the order; docs/architecture.md shows it.
"""

"""The job's store: the key-value store the agent and its workers share (``launcher.store``).

Owns the private (Unix socket) and token (TCP behind a handshake) servers and their wire, the etcd client, where a
server listens, and picking a store by kind and connecting to one by its address (stores.py). Imports no other
room of distributed/ (not even protocol.py): it moves bytes, and knows nothing of what the records mean.

Torch only where a worker needs it: the clients are plain classes (base.py), which the agent, node agents and
``elasticflow status`` use; dist_store.py makes them ``torch.distributed.Store`` for a worker's gloo
(``stores.connect``).
"""

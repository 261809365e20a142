"""One worker's replica of the training state, kept equal to every other member's through failures: the step's
reduction (``replica``, ``step_reduction``, ``bucketing``), the state at a membership change (``replica``,
``shard_handover``), sharded state (``shard``, ``shard_plan``, ``flat_update``) and the
parameter server's roles (``parameter_server``)."""

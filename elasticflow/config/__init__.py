"""The configuration: the schema of conf/ (``schema``), each numeric key's range (``ranges``), what each key
means for ``--help`` (``help``), the topology graph (``topology``), where a worker computes (``devices``) and
the optimizer specs and schedules (``optim``, public as ``elasticflow.optim``)."""

"""The configuration: the schema of conf/ (``schema``), each numeric key's range (``ranges``), what each key
means for ``--help`` (``help``), the topology graph (``topology``) and where a worker computes (``devices``)."""

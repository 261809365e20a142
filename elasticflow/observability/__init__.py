"""What a run shows and leaves behind: the run log and step records (``reporting``), TensorBoard, the goodput
ledger, and the ``plot`` and ``status`` commands that read a run's records."""

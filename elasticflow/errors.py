"""The one exception type users see: what happened, and how to fix it."""


class ElasticFlowError(Exception):
    """A mistake in the user's input or a condition that stops training.

    The CLI prints ``error: <message>`` and ``hint: <hint>`` and exits with ``exit_code``;
    the traceback is shown only with ``--debug``.
    """

    def __init__(self, message: str, hint: str = "", exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message

    def __reduce__(self):  # keeps the hint across processes (a data loader's error reaches the trainer)
        return self.__class__, (self.message, self.hint, self.exit_code)


class CheckpointMismatch(ElasticFlowError):
    """A checkpoint written by another model or optimizer: no older checkpoint of the job fits either,
    so resume=auto must stop rather than fall back (or silently start fresh)."""


class RunDirectoryMoved(ElasticFlowError):
    """The run directory's path leads to another directory than the one the job started in (it, or a folder
    above it, was renamed): the job stops, and writes nothing more by that path (``_util.paths.HeldDirectory``)."""


class TrainingInterrupted(Exception):
    """Ctrl-C: the current step finished and a checkpoint was written; the CLI exits 130."""

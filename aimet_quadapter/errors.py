"""The one exception type a user should ever see from this package."""


class QuadapterError(Exception):
    """A problem the user can fix (a bad option, a missing file, an unreachable hub).

    The CLI prints its message on one line and exits with status 2, without a traceback:
    the message itself must name the bad field, file or model and say what to do.
    """


class TrainingDiverged(QuadapterError):
    """A training loss became NaN or infinite: the method stops there; a run's other cells go on."""

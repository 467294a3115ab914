"""The one exception type a user should ever see from this package."""


class QuadapterError(Exception):
    """A problem the user can fix; the CLI prints its message on one line (it must name the bad field, file or model
    and say what to do) and exits with status 2."""


class TrainingDiverged(QuadapterError):
    """A training loss became NaN or infinite: the method stops there; a run's other cells go on."""

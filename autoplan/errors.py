"""User-facing errors: each says what was wrong and what would help; the CLI maps them to exit codes."""


class AutoplanError(Exception):
    """A mistake or impossibility the user can act on. `exit_code` is what the CLI exits with."""

    exit_code = 1

    def __reduce__(self):
        # pickled with its fields (an InfeasibleError's smallest limit, the pins of a PinsInfeasibleError): the
        # mesh search hands errors back from its worker processes
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type, args: tuple, state: dict) -> AutoplanError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class UsageError(AutoplanError):
    """Bad command-line or API input (an unparsable size, an unknown name)."""

    exit_code = 2


class InfeasibleError(AutoplanError):
    """No plan fits the memory limit. Carries the smallest limit that would fit, when known."""

    exit_code = 3

    def __init__(self, message: str, min_mem_bytes: int | None = None):
        super().__init__(message)
        self.min_mem_bytes = min_mem_bytes


class PlanFileError(AutoplanError):
    """A plan file that cannot be read, is corrupt, or does not match the model it is applied to."""

    exit_code = 2


class CheckpointError(AutoplanError):
    """A checkpoint folder that cannot be loaded: none there, unfinished, corrupt, or of another model."""

    exit_code = 2


class TraceError(AutoplanError):
    """The model could not be traced; the message names the failing module or op."""

    exit_code = 2


class SolverTimeout(AutoplanError):
    """The solver's time limit ran out before any verdict (no plan, no proof that none fits)."""

    exit_code = 1

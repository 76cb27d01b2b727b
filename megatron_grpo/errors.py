"""The project's user-facing errors. Each carries one message that names what is wrong and where."""


class MegatronGRPOError(Exception):
    """Base class: an error the CLI prints as one line (no traceback) and exits with `exit_code`."""

    exit_code = 1


# Exit codes: 0 done or stopped by a signal after a checkpoint, 1 a runtime failure, 2 a config or data
# error, 3 a hang (the watchdog or a collective timeout; launch/watchdog.py), 130 a second Ctrl-C.
HANG_EXIT_CODE = 3


class ConfigError(MegatronGRPOError):
    """A recipe, override or cross-field check is wrong; raised before anything heavy starts."""

    exit_code = 2


class DataError(MegatronGRPOError):
    """A dataset line or file is malformed; the message names file:line."""

    exit_code = 2


class LaunchError(MegatronGRPOError):
    """The launcher environment (ranks, devices, master address) is missing or inconsistent."""


class RolloutFailure(MegatronGRPOError):
    """The rollout engines failed on rank 0 (generation after the client's retries, or a weight
    sync); raised on every rank, so that all stop together after checkpointing."""


class CheckpointError(MegatronGRPOError):
    """A checkpoint or HF model folder is missing, incomplete or does not match the config."""


class MissingExtraError(MegatronGRPOError, ImportError):
    """An optional dependency is not installed; the message names the pip extra to install."""


class Rank0Failure(MegatronGRPOError):
    """Global rank 0 failed with an unexpected error in work the other ranks wait on; raised on
    those ranks (rank 0 raises the original), so that no rank is left waiting in a collective."""


class HangError(MegatronGRPOError):
    """A rank made no progress for trainer.hang_timeout_s, or a collective timed out; the message is
    the watchdog's summary line (launch/watchdog.py)."""

    exit_code = HANG_EXIT_CODE

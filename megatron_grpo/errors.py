"""The project's user-facing errors. Each carries one message that names what is wrong and where."""


class MegatronGRPOError(Exception):
    """Base class: an error the CLI prints as one line (no traceback) and exits with `exit_code`."""

    exit_code = 1


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

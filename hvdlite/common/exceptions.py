"""Exception types with Horovod's names, so `except hvd.HorovodInternalError` keeps working."""


class HorovodInternalError(RuntimeError):
    """A collective failed or the job's communicator broke (dead peer, mismatch, shutdown).

    Raised on every surviving rank; elastic training catches it, rolls back and re-forms the job.
    """


class HorovodMismatchError(HorovodInternalError):
    """The ranks disagreed about a collective (shape, dtype, op, root, ...): the coordinator's
    error response, raised on every rank of the set. A HorovodInternalError as in Horovod; the
    TensorFlow frontend reports it as tf.errors.FailedPreconditionError, as Horovod's kernels."""


class NotInitializedError(HorovodInternalError, ValueError):
    """A collective called before hvd.init() (or after hvd.shutdown()). Horovod raises
    HorovodInternalError there (its C++ refuses the enqueue); a ValueError too, which hvdlite
    raised before and which Horovod's rank()/size() raise before init."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed; elastic training re-forms the job without restoring state."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(ImportError):
    """Kept for API compatibility: hvdlite has no compiled extension, so this is never raised."""

    def __init__(self, name: str = "", version: str = "", framework_version: str = ""):
        super().__init__(f"Framework {name} installed with version {version} but found version "
                         f"{framework_version}.")
        self.name = name
        self.version = version
        self.framework_version = framework_version

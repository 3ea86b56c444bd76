"""What a failed etcd request raises, whichever module of the store made it."""


class StoreError(RuntimeError):
    """An etcd request failed."""


class StoreUnavailable(StoreError):
    """etcd could not be reached at the configured endpoint."""

from torch.utils.checkpoint import CheckpointError


class RecomputeError(CheckpointError):
    """A violation of the recompute contract (a ``torch.utils.checkpoint.CheckpointError``).

    Raised when the rerun in backward saves tensors whose shape, dtype or device
    differ from the forward's, saves a different number of them, or when marked
    modules are nested.
    """

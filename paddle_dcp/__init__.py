"""paddle_dcp: distributed checkpoints for PaddlePaddle semi-auto-parallel training.

Switch with one import::

    import paddle_dcp as dcp
    dcp.save_state_dict(state_dict, "ckpt")
    dcp.load_state_dict(state_dict, "ckpt")
"""
from .api import AsyncSave, close, load_state_dict, process_state, read_metadata, save_state_dict, wait_async_save
from .errors import (
    ArgumentError,
    CollectiveError,
    CollectiveMismatchError,
    DcpError,
    FormatError,
    IntegrityError,
    MismatchError,
    PlanError,
    StateDictError,
    StorageError,
    UnsupportedError,
)
from .gather import save_gathered
from .manager import CheckpointManager
from .core.metadata import FORMAT_VERSION
from .core.compress import ADAMW_MOMENTS, ADAMW_MOMENTS_INT4, ADAMW_MOMENTS_INT8, MASTER_WEIGHTS_DERIVED
from .core.derive import MASTER_WEIGHTS
from .patching import PaddlePatch, StateDictMetadata, patch_paddle, read_state_dict_metadata
from .training import get_state_dict, set_state_dict
from .version import __version__
from .patching import watch_buffers as _watch_buffers

_watch_buffers()  # notes buffers paddle's shard_layer makes persistable (paddle_dcp.patching)

__all__ = [
    "save_state_dict",
    "load_state_dict",
    "read_metadata",
    "wait_async_save",
    "close",
    "process_state",
    "AsyncSave",
    "CheckpointManager",
    "save_gathered",
    "get_state_dict",
    "set_state_dict",
    "patch_paddle",
    "PaddlePatch",
    "read_state_dict_metadata",
    "StateDictMetadata",
    "DcpError",
    "ArgumentError",
    "FormatError",
    "IntegrityError",
    "MismatchError",
    "StateDictError",
    "StorageError",
    "CollectiveError",
    "CollectiveMismatchError",
    "PlanError",
    "UnsupportedError",
    "FORMAT_VERSION",
    "ADAMW_MOMENTS",
    "ADAMW_MOMENTS_INT8",
    "ADAMW_MOMENTS_INT4",
    "MASTER_WEIGHTS",
    "MASTER_WEIGHTS_DERIVED",
    "__version__",
]

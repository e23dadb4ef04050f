"""What a caller asked of one save or load, as one frozen value each: the api checks the
arguments once and builds these; the rank, the load's planning and the manager's tiers carry
them as they are, instead of a dozen keyword arguments passed from signature to signature."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..core.compress import Policy
from ..core.keys import MissingKeys


@dataclass(frozen=True)
class SaveOptions:
    """How a save writes (``save_state_dict``'s options).

    Attributes:
        safetensors: every rank's data file is a safetensors file.
        replicas: every holder of a replicated piece writes its own copy (``save_replicas``).
        durable: fsync the data files, the metadata and the directory.
        staged: an async save (the pieces staged in host memory, the rest in the background).
        compress: the keys stored quantized or derived (None: none).
    """

    safetensors: bool = False
    replicas: bool = False
    durable: bool = False
    staged: bool = False
    compress: Policy | None = None

    @property
    def file_kind(self) -> str:
        """The extension of a rank's data file."""
        return "safetensors" if self.safetensors else "distcp"


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads and fills (``load_state_dict``'s options).

    Attributes:
        offload: host buffers without pinned memory for tensors on a device.
        mw_name_compatibility: ``master_weights.X`` loads from ``X_fp32_master_0`` and back.
        aoa_config: paddle's key and layout transformations (None: none).
        safetensors: the directory may be one of safetensors files.
        near: ranks that share a worker group with this one (``worker_groups``).
        verify: check the checksum of every block read before a target changes.
        missing: what a state-dict key the checkpoint lacks is (strict, or allowed).
        exclude: files this rank must not read (found damaged): taken from other ranks.
    """

    offload: bool = False
    mw_name_compatibility: bool = True
    aoa_config: Mapping[str, Any] | None = None
    safetensors: bool = False
    near: frozenset = frozenset()
    verify: bool = True
    missing: MissingKeys = MissingKeys()
    exclude: frozenset = frozenset()

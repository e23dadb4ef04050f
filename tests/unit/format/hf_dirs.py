"""A Hugging Face directory written by the ``safetensors`` package (one file, or shards and an
index), and the arrays it holds: the oracle of the tests that read such directories."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def hf_directory(path, arrays: dict, shards: list[list[str]] | None) -> Path:
    path = Path(path)
    path.mkdir()
    if shards is None:
        save_file(arrays, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: arrays[k] for k in keys}, str(path / name))
        weight_map.update(dict.fromkeys(keys, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


ARRAYS = {
    "embed.w": np.arange(48, dtype=np.float32).reshape(8, 6),
    "head.b": np.arange(5, dtype=np.int64) - 2,
    "norm": np.linspace(0, 1, 7).astype(np.float16),
}

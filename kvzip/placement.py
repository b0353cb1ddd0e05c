"""Models larger than one device: accelerate's placement of a model's modules over the devices (`device_map`), read
and checked before the model loads, and each decoder layer's device once it has, which a cache's per-layer state
(dictionary atoms, zoomr's detail tier) follows.

transformers hands `device_map` to accelerate, which places whole modules: `auto`, `balanced`, `balanced_low_0` and
`sequential` fill the visible GPUs by memory (the CPU when there is none), or a map names a device for each module
(`{"model.embed_tokens": 0, "model.layers.0": 0, ..., "lm_head": 1}`). Each layer's attention then runs where its
weights are (modules mapped to the CPU beside GPUs are offloaded: they run on the first GPU), and kvzip's cache layers
allocate from the keys they receive, so every cache layer lives on its layer's device. Disk offload is refused: a
cache that reads every layer's weights from disk at every token is not a use kvzip serves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kvzip.errors import UserError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_CUDA = re.compile(r"cuda(?::(\d+))?")


def parse_device_map(text: str) -> str | dict[str, int | str]:
    """A placement strategy name, or a JSON object (inline, or a .json file) of module name -> device: a GPU index,
    "cuda:N" or "cpu". UserError naming what is allowed otherwise."""
    if text in STRATEGIES:
        return text
    source = text
    if text.endswith(".json") and Path(text).is_file():
        source = Path(text).read_text()
    try:
        mapping = json.loads(source)
    except json.JSONDecodeError:
        mapping = None
    if not isinstance(mapping, dict) or not mapping:
        raise UserError(f"a device map is one of {', '.join(STRATEGIES)}, or a JSON object of module name -> device "
                        f"(a GPU index, \"cuda:N\" or \"cpu\"), inline or in a .json file; got {text!r}")
    for name, device in mapping.items():
        if device == "disk":
            raise UserError(f"the device map puts '{name}' on disk: disk offload is not supported, use GPUs and the CPU")
        ok = (isinstance(device, int) and not isinstance(device, bool) and device >= 0) or device == "cpu" or (
            isinstance(device, str) and _CUDA.fullmatch(device) is not None)
        if not isinstance(name, str) or not ok:
            raise UserError(f"the device map gives '{name}' the device {device!r}: use a GPU index, \"cuda:N\" or \"cpu\"")
    return mapping


def check_device_map(device_map: str | dict, gpus: int) -> None:
    """Every GPU a map names is visible (a strategy adapts to what there is)."""
    if isinstance(device_map, str):
        return
    for name, device in device_map.items():
        index = device if isinstance(device, int) else None
        if isinstance(device, str) and device != "cpu":
            index = int(_CUDA.fullmatch(device).group(1) or 0)
        if index is not None and index >= gpus:
            raise UserError(f"the device map puts '{name}' on GPU {index}, but torch sees {gpus} GPU(s)")


def _execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where accelerate runs `module` (its hook's execution device), or None when no hook places it."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return None


def layer_devices(model) -> list[torch.device]:
    """The device each decoder layer computes on, in layer order: where a device map placed it, else where its weights
    are. A model whose layers cannot be found is taken to be on one device, `model.device`."""
    count = model.config.num_hidden_layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None or len(layers) != count:
        return [model.device] * count
    devices = []
    for layer in layers:
        placed = _execution_device(layer)
        weight = next(layer.parameters(), None)
        devices.append(placed or (weight.device if weight is not None else model.device))
    return devices

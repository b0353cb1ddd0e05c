"""KVDictionary: per-layer key and value dictionaries in one safetensors file, with a model fingerprint.

A dictionary coded for one model is garbage for another, so the file carries the fingerprint of the model it was
learned on (architecture, layer count, KV heads, head_dim, RoPE base, config hash) and `check_fingerprint` turns a
mismatch into one clear line. Loading uses safetensors only (no pickle); every way a file can be wrong (missing,
truncated, not safetensors, tensors missing, other format version) is a `DictionaryError` with one line. Saving
is atomic (kvzip.files.atomic_path): an interrupted save leaves neither a partial target nor the temp file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvzip.files import atomic_path
from kvzip.rope import to_pairs
from kvzip.sparse import KEY_MODES
from kvzip.sparse.omp import gram_matrix

FORMAT_VERSION = "1"
FINGERPRINT_KEYS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "rope_theta", "config_hash")
_REQUIRED = ("keys", "values")
_OPTIONAL = ("key_mean",)


class DictionaryError(ValueError):
    """A dictionary file that cannot be used: the message is one line saying what and what to do."""


@dataclass
class KVDictionary:
    """keys, values: (L, N, d) unit-norm atoms per layer, shared by the layer's KV heads.

    key_mean: optional (L, Hkv, d) per-head key offset subtracted before coding (added back, or dropped where the
    attention math allows).
    meta: string metadata; `make_meta` builds the standard keys.
    """
    keys: torch.Tensor
    values: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)
    key_mean: torch.Tensor | None = None
    # `prepare_layers` results by (device, pairing, layers): a dictionary is prepared once, however many caches use it
    prepared: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        assert self.keys.dim() == 3 and self.keys.shape == self.values.shape, \
            f"keys and values must both be (L, N, d), got {tuple(self.keys.shape)} and {tuple(self.values.shape)}"
        L, _, d = self.keys.shape
        if self.key_mean is not None:
            assert self.key_mean.dim() == 3 and self.key_mean.shape[0] == L and self.key_mean.shape[2] == d, \
                f"key_mean must be (L, Hkv, d), got {tuple(self.key_mean.shape)}"
        self.meta = {str(k): str(v) for k, v in self.meta.items()}

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_atoms(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[2]

    @property
    def fingerprint(self) -> dict:
        return json.loads(self.meta.get("fingerprint", "{}"))

    def save(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write atomically to path (safetensors + string metadata); `dtype` (e.g. fp16) stores the tensors smaller.

        `load` upcasts every tensor to fp32, so a file stored in fp16 loads exactly as its rounded atoms.
        """
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tensors = {"keys": self.keys, "values": self.values}
        if self.key_mean is not None:
            tensors["key_mean"] = self.key_mean
        tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in tensors.items()}
        meta = {**self.meta, "format_version": FORMAT_VERSION, "atoms": str(self.num_atoms)}
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> "KVDictionary":
        """Read a dictionary written by `save`; every unusable file raises DictionaryError with one line."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DictionaryError(f"dictionary file not found: {path}; train one with `kvzip train-dict`")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                meta = dict(f.metadata() or {})
                names = set(f.keys())
                missing = [k for k in _REQUIRED if k not in names]
                if missing:
                    raise DictionaryError(f"{path} is not a kvzip dictionary: tensor(s) {', '.join(missing)} missing")
                tensors = {k: f.get_tensor(k) for k in _REQUIRED + _OPTIONAL if k in names}
        except DictionaryError:
            raise
        except Exception as e:                                # safetensors raises several types for bad files
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DictionaryError(f"{path} is truncated or not a safetensors file ({reason}); "
                                  f"re-create it with `kvzip train-dict`") from None
        version = meta.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise DictionaryError(f"{path} has dictionary format version {version or 'none'}, this kvzip reads "
                                  f"version {FORMAT_VERSION}; re-create it with `kvzip train-dict`")
        try:
            tensors = {k: v.to(device, torch.float32) for k, v in tensors.items()}
            return cls(meta=meta, **tensors)
        except AssertionError as e:
            raise DictionaryError(f"{path} has inconsistent tensor shapes ({e}); "
                                  f"re-create it with `kvzip train-dict`") from None

    def check_fingerprint(self, expected: dict) -> None:
        """Raise DictionaryError naming the first differing fingerprint field, if the model does not match."""
        have = self.fingerprint
        for key in FINGERPRINT_KEYS:
            if key in expected and str(have.get(key)) != str(expected[key]):
                what = key.replace("_", " ")
                raise DictionaryError(
                    f"dictionary was made for a model with {what} {have.get(key, 'unknown')}, this model has "
                    f"{what} {expected[key]}; train one with `kvzip train-dict`")


class LayerAtoms(NamedTuple):
    """One layer's dictionary as a cache codes with it: fp32 atoms (N, d) and Gram matrices (N, N) on the device,
    and the per-KV-head key mean (Hkv, d) or None. The Gram matrices of all layers are one tensor `grams`
    (2 x layers, N, N), keys then values per layer, so a coder can read any layer's entries in one gather: this
    layer's are slots `slot` (keys) and `slot + 1` (values)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_gram: torch.Tensor
    value_gram: torch.Tensor
    key_mean: torch.Tensor | None
    grams: torch.Tensor
    slot: int


def prepare_layers(dictionaries: KVDictionary, device, paired: bool | list[int] = False,
                   layers: list[int] | None = None) -> list[LayerAtoms]:
    """Per layer: the atoms and Gram matrices a cache codes with, computed once per dictionary, device and pairing.

    `paired`: key atoms and key mean in `to_pairs` order, as layers coding pre-RoPE keys keep them (the Gram matrix
    does not change); True pairs every channel, a list gives each layer's rotary width (partial rotary leaves the
    other channels in place). `layers`: only these layers (default: all), in this order, their Gram matrices
    stacked alone (the layers a device holds, when a model is split over several)."""
    picked = tuple(range(dictionaries.num_layers)) if layers is None else tuple(layers)
    key = (str(device), paired if isinstance(paired, bool) else tuple(paired), picked)
    if key not in dictionaries.prepared:
        atoms = []
        for i in picked:
            d_k = dictionaries.keys[i].half().float().to(device)  # fp16-exact, as files store them and the fused
            d_v = dictionaries.values[i].half().float().to(device)  # attention kernel reads them
            mean = None if dictionaries.key_mean is None else dictionaries.key_mean[i].float().to(device)
            if paired:
                dim = None if paired is True else paired[i]
                d_k = to_pairs(d_k, dim).contiguous()
                mean = None if mean is None else to_pairs(mean, dim).contiguous()
            atoms.append((d_k, d_v, mean))
        grams = torch.stack([gram_matrix(d) for d_k, d_v, _ in atoms for d in (d_k, d_v)])  # (2L, N, N)
        # every layer's key and value atoms as views of one (2L, N, d) allocation, so that a coder reading all of a
        # cache's dictionaries at once reads them in place (kvzip.methods.coded.coding.stacked_atoms)
        stack = torch.stack([d for d_k, d_v, _ in atoms for d in (d_k, d_v)])
        dictionaries.prepared[key] = [LayerAtoms(stack[2 * i], stack[2 * i + 1], grams[2 * i], grams[2 * i + 1], mean,
                                                 grams, 2 * i) for i, (_, _, mean) in enumerate(atoms)]
    return dictionaries.prepared[key]


def prepare_for_devices(dictionaries: KVDictionary, devices: list, paired: bool | list[int] = False) -> list[LayerAtoms]:
    """prepare_layers for a model whose layer i computes on devices[i]: each device holds its own layers' atoms and
    Gram matrices (a LayerAtoms' `grams` and `slot` are then those of its device's stack)."""
    out: list = [None] * len(devices)
    for device in dict.fromkeys(devices):
        mine = [i for i, d in enumerate(devices) if d == device]
        for i, atoms in zip(mine, prepare_layers(dictionaries, device, paired, None if len(mine) == len(devices) else mine)):
            out[i] = atoms
    return out


def make_meta(fingerprint: dict, s: int, keys: str, source: str, tokens: int,
              key_error: list[float] | None = None, value_error: list[float] | None = None,
              **extra: str) -> dict[str, str]:
    """Standard metadata for a KVDictionary: all values strings, lists/dicts JSON-encoded."""
    if keys not in KEY_MODES:
        raise ValueError(f"keys must be one of {', '.join(KEY_MODES)}, got {keys!r}")
    meta = {"fingerprint": json.dumps(fingerprint, sort_keys=True), "sparsity": str(s), "keys": keys,
            "calibration_source": source, "calibration_tokens": str(tokens)}
    if key_error is not None:
        meta["heldout_key_error"] = json.dumps([round(float(e), 5) for e in key_error])
    if value_error is not None:
        meta["heldout_value_error"] = json.dumps([round(float(e), 5) for e in value_error])
    meta.update({k: str(v) for k, v in extra.items()})
    return meta

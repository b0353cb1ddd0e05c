"""Find and load the dictionaries a method needs, checked against the model they will serve.

Shipped dictionaries live in the top-level `dictionaries/` folder as `<model-name>.safetensors`. The package reaches
them as `kvzip/_dictionaries`, a link to that folder in a checkout and a real folder inside an installed wheel (the
wheel is built through the link), so the same lookup works in both. `$KVZIP_DICTIONARIES` points elsewhere; an
explicit path names one file.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvzip.errors import UserError


def dictionary_dir() -> Path:
    """Where default dictionaries are looked up (and `train-dict` writes by default)."""
    env = os.environ.get("KVZIP_DICTIONARIES")
    return Path(env) if env else (Path(__file__).parent / "_dictionaries").resolve()


def check_dictionary_file(path: Path) -> Path:
    """`path` when it is a file; UserError for a missing path or a directory (before any model work)."""
    if path.is_dir():
        raise UserError(f"{path} is a directory, not a dictionary file: give a .safetensors file made by train-dict")
    if not path.is_file():
        raise UserError(f"dictionary file {path} does not exist")
    return path


def default_dictionary_path(source, keys: str = "post-rope") -> Path:
    """`<model>.safetensors` (keys after RoPE), or `<model>-prerope.safetensors` for keys coded before RoPE."""
    return dictionary_dir() / f"{source.name}{'-prerope' if keys == 'pre-rope' else ''}.safetensors"


def _wanted_keys(method, source, strict: bool = False) -> str:
    """The key mode of the default dictionary file for a method: its `keys` option, or with keys=auto its preferred
    mode when that file is shipped, else the other mode's file (strict: the preferred mode, for the error message)."""
    keys = getattr(method, "keys", "post-rope")
    if keys != "auto":
        return keys
    preferred = getattr(method, "preferred_keys", "post-rope")
    if strict or default_dictionary_path(source, preferred).is_file():
        return preferred
    other = "post-rope" if preferred == "pre-rope" else "pre-rope"
    return other if default_dictionary_path(source, other).is_file() else preferred


def dictionaries_for(method, model, source, path: Path | None = None):
    """The checked KVDictionary for a method that needs one, else None. UserError when missing or mismatched."""
    if not getattr(method, "needs_dictionary", False):
        return None
    from kvzip.models import model_fingerprint
    from kvzip.sparse.dictionary import DictionaryError, KVDictionary

    if path is not None:
        path = check_dictionary_file(Path(path))
    path = path or default_dictionary_path(source, _wanted_keys(method, source))
    if not path.is_file():
        raise UserError(
            f"method '{method.name}' needs a dictionary and {path} does not exist: train one with "
            f"`kvzip train-dict --model {source.name} --keys {_wanted_keys(method, source, strict=True)} --out {path}` "
            f"or pass --dict"
        )
    try:
        dictionary = KVDictionary.load(path, device=str(model.device))
        dictionary.check_fingerprint(model_fingerprint(model.config))
    except DictionaryError as exc:
        raise UserError(str(exc)) from None
    return dictionary

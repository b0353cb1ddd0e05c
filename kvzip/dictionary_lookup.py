"""Find and load the dictionaries a method needs, checked against the model they will serve.

Shipped dictionaries live in the top-level `dictionaries/` folder as `<model-name>.safetensors` (keys coded after
RoPE) and `<model-name>-prerope.safetensors` (before). The package reaches them as `kvzip/_dictionaries`, a link to
that folder in a checkout and a real folder inside an installed wheel (the wheel is built through the link), so the
same lookup works in both. `$KVZIP_DICTIONARIES` points elsewhere; an explicit path names one file.

Which default file a method wants is the method's to say, through one call:

    Method.dictionary_keys() -> tuple[str, ...]

the key modes (`kvzip.sparse.KEY_MODES`) of the dictionaries the method, with its options, can run on, the one to
look for first first; `()` for a method that uses no dictionary. The first mode whose default file exists is taken;
when none exists, the first mode's file is the one a `MissingDictionary` error names.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvzip.errors import UserError


class MissingDictionary(UserError):
    """A method's default dictionary file does not exist. Carries the method, the file, the model's name and the key
    mode, so that a front end can say how to make the file in its own words."""

    def __init__(self, method: str, path: Path, model: str, keys: str):
        self.method, self.path, self.model, self.keys = method, path, model, keys
        super().__init__(f"method '{method}' needs a dictionary and {path} does not exist: train one for model "
                         f"{model} with {keys} keys and save it there, or give the path of another dictionary file")


def dictionary_dir() -> Path:
    """Where default dictionaries are looked up (and `train-dict` writes by default)."""
    env = os.environ.get("KVZIP_DICTIONARIES")
    return Path(env) if env else (Path(__file__).parent / "_dictionaries").resolve()


def check_dictionary_file(path: Path) -> Path:
    """`path` when it is a file; UserError for a missing path or a directory (before any model work)."""
    if path.is_dir():
        raise UserError(f"{path} is a directory, not a dictionary file: give a dictionary's .safetensors file")
    if not path.is_file():
        raise UserError(f"dictionary file {path} does not exist")
    return path


def default_dictionary_path(source, keys: str = "post-rope") -> Path:
    """`<model>.safetensors` (keys after RoPE), or `<model>-prerope.safetensors` for keys coded before RoPE."""
    return dictionary_dir() / f"{source.name}{'-prerope' if keys == 'pre-rope' else ''}.safetensors"


def key_modes(method) -> tuple[str, ...]:
    """`method.dictionary_keys()` (module docstring), checked to be a non-empty sequence of key modes."""
    from kvzip.sparse import KEY_MODES

    modes = tuple(method.dictionary_keys())
    assert modes and all(m in KEY_MODES for m in modes), f"{method.name}: dictionary_keys() gave {modes!r}"
    return modes


def default_dictionary(method, source) -> Path:
    """The default file for `method`: the first of its key modes whose file exists; MissingDictionary if none."""
    modes = key_modes(method)
    for keys in modes:
        path = default_dictionary_path(source, keys)
        if path.is_file():
            return path
    raise MissingDictionary(method.name, default_dictionary_path(source, modes[0]), source.name, modes[0])


def dictionaries_for(method, model, source, path: Path | None = None):
    """The checked KVDictionary for a method that needs one, else None. UserError when missing or mismatched."""
    if not method.needs_dictionary:
        return None
    from kvzip.models import model_fingerprint
    from kvzip.sparse.dictionary import DictionaryError, KVDictionary

    path = check_dictionary_file(Path(path)) if path is not None else default_dictionary(method, source)
    try:
        dictionary = KVDictionary.load(path, device=str(model.device))
        dictionary.check_fingerprint(model_fingerprint(model.config))
    except DictionaryError as exc:
        raise UserError(str(exc)) from None
    return dictionary

"""What a dictionary-coded cache layer keeps per kind of vector, and how it codes and adapts (package-internal; the
methods, their options and their docs are kvzip/methods/fadkv.py and docs/fadkv.md):

- `state`: `CodedKind`, one kind's (keys' or values') coded tier of a layer: the shared dictionary it codes over,
  the batch's codes, each row's own overlay atoms and atom use counts;
- `coding`: coding new vectors with each row's dictionary, every layer, kind and row of a step in one coder pass,
  and fixed-size adaptation (`code_kinds`, `adapt`).

The registry (kvzip/methods/__init__.py) looks for methods in kvzip/methods/'s own modules only, not in here.
"""

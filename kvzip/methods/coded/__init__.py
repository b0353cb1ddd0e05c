"""A dictionary-coded cache layer, what it keeps per kind of vector, and how it attends, codes and adapts
(package-internal; the methods, their options and their docs are kvzip/methods/fadkv.py and docs/fadkv.md). Imports
run one way, from the layer down: `forward` and `layer` -> `attend` -> `state`; `compress` -> `coding` -> `state`.

- `state`: `CodedKind`, one kind's (keys' or values') coded tier of a layer: the shared dictionary it codes over,
  the batch's codes, each row's own overlay atoms and atom use counts;
- `attend`: attention on a layer's tiers as a function of explicit inputs (`coded_attention`);
- `forward`: what one forward hands every layer (`CodedState`, built by the cache's `before_forward`);
- `layer`: `FadkvLayer`, which stores its tokens and attends with what it is handed;
- `coding`: coding new vectors with each row's dictionary, every layer, kind and row of a step in one coder pass,
  and fixed-size adaptation (`code_kinds`, `adapt`); `compress`: which tokens each row codes, after a forward.

The registry (kvzip/methods/__init__.py) looks for methods in kvzip/methods/'s own modules only, not in here.
"""

"""Dictionary coding of KV vectors as pure tensor functions, and the names every caller of them shares.

The modules below hold the tensor code (the coders `omp` and `screen`, dictionary learning, attention on codes, the
dictionary file). The names of their choices live here, once, so that the capture, the training command, the file
format and the cache methods accept the same words, and so that the command line can check a flag against them
without importing torch:

- `KEY_MODES`: where a dictionary's key atoms live. `post-rope`: keys as the cache stores them, RoPE applied (the
  key mean is a per-query constant shift of the scores, so softmax drops it). `pre-rope`: keys with RoPE turned
  back, as the projection wrote them (the mean must be added back before rotating). A dictionary file records its
  mode in its metadata.
- `KEY_OPTIONS`: what a method's key option accepts: a mode, or `auto` (the mode the dictionary was trained in).
- `CODERS`: the sparse coders dictionary learning can run in its loop (`kvzip.sparse.learn.encode`): `screen1`
  (one-shot screening, exact top-n pool), `screen` (two shots, champion pools) and `omp`.
- `CACHE_CODERS`: the coders a cache codes new tokens with (one-shot screening is `screen` with `shots=1` there).
"""

KEY_MODES = ("post-rope", "pre-rope")
KEY_OPTIONS = ("auto", *KEY_MODES)
CODERS = ("screen1", "screen", "omp")
CACHE_CODERS = ("screen", "omp")

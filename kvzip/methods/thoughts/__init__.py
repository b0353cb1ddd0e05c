"""What zoomr and sumr share, one responsibility per module (package-internal; the methods themselves, their options
and their docs are kvzip/methods/zoomr.py and sumr.py, docs/zoomr.md):

- `segment`: where a row's decoded text is cut into thoughts (`Segmentation`, `Row`);
- `summary`: which tokens of a finished thought stay on the device as its summary;
- `index`: a thought's index key, the votes of the query heads and the zoom set they choose (`ranked`, `Ballot`);
- `detail`: the detail tier, every finished thought's full K/V off the compute device (int8, dense, or codes);
- `layer`: the cache layer, its configuration and what each forward hands it (`ThoughtLayer`, `ThoughtConfig`,
  `ThoughtState`);
- `finalize`, `rebuild`: a thought's end and the rebuild of rows that moved, in every layer at once, on the layers
  and rows' state they are handed;
- `cache`: the cache that ties these together (`ThoughtCache`). Imports run one way: `cache` -> `finalize`,
  `rebuild` -> `layer`; no module below `cache` imports it.

The registry (kvzip/methods/__init__.py) looks for methods in kvzip/methods/'s own modules only, not in here.
"""

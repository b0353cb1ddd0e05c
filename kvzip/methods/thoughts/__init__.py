"""What zoomr and sumr share, one responsibility per module (package-internal; the methods themselves, their options
and their docs are kvzip/methods/zoomr.py and sumr.py, docs/zoomr.md):

- `segment`: where a row's decoded text is cut into thoughts (`Segmentation`, `Row`);
- `summary`: which tokens of a finished thought stay on the device as its summary;
- `index`: a thought's index key, the votes of the query heads and the zoom set they choose (`ranked`, `Ballot`);
- `detail`: the detail tier, every finished thought's full K/V off the compute device (int8, dense, or codes);
- `cache`: the cache layers and the cache that tie these together (`ThoughtConfig`, `ThoughtLayer`, `ThoughtCache`).

The registry (kvzip/methods/__init__.py) looks for methods in kvzip/methods/'s own modules only, not in here.
"""

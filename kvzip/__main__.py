"""`python -m kvzip` runs the kvzip command, as the console script does; it is what torchrun launches on every rank:

    torchrun --nproc-per-node 2 -m kvzip generate --input prompts.jsonl --output out.jsonl
"""

from kvzip.cli import main

main()

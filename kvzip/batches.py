"""A JSONL generation job cut into batches of consecutive rows: each batch generated whole and kept as one piece, its
rows tagged with their input index; the pieces of any ranks and any runs merged back in input order.

Batches, not single rows, are what ranks share and what a resume redoes. Batch k is always rows k*B to k*B+B-1 (B the
batch size), so a row is decoded beside the same neighbours, under the same left padding, however many ranks run and
whichever rank takes it: a data-parallel or resumed run writes the same tokens as one uninterrupted process, by
construction, for every method. A batch cut short by Ctrl-C is not kept (its finished rows neither): on resume it is
generated again, whole, beside the same neighbours.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

from kvzip import engine


def batch_rows(n_rows: int, batch_size: int) -> list[range]:
    """The rows of each batch, in input order."""
    return [range(start, min(start + batch_size, n_rows)) for start in range(0, n_rows, batch_size)]


def piece_name(batch: int) -> str:
    return f"batch-{batch:06d}"


def row_record(item, result: engine.Result) -> dict:
    """One output line: the prompt as given, the completion and the row's own figures."""
    return {
        "prompt": item,
        "completion": result.text,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "new_tokens": len(result.token_ids),
        "tokens": result.token_ids,
    }


@dataclass
class Batch:
    """A generated batch: its index, one record per row in order, the engine's Summary stats (with `first_row`)."""

    index: int
    rows: range
    records: list[dict]
    stats: dict

    @property
    def interrupted(self) -> bool:
        return any(r["finish_reason"] == "interrupted" for r in self.records)

    def piece(self, rank: int, run: str) -> dict:
        """What the pieces folder keeps: the rows with their input index, the batch's figures, who made it."""
        return {"batch": self.index, "rank": rank, "run": run,
                "rows": [{"index": i, **r} for i, r in zip(self.rows, self.records)],
                "stats": {**self.stats, "rank": rank, "run": run}}


def generate_batch(model, tokenizer, method, dictionaries, items: list, prompts: list[list[int]], index: int,
                   rows: range, settings: engine.Settings, on_event: Callable | None = None) -> Batch:
    """Generate batch `index` (rows `rows` of `items`, token ids in `prompts`) in a new cache of `method`.
    on_event(event) sees every engine event (a Token to stream, a Result to count)."""
    cache = method.make_cache(model, dictionaries)
    records, stats = [], {}
    for event in engine.generate(model, tokenizer, [prompts[i] for i in rows], cache, settings):
        if on_event is not None:
            on_event(event)
        if isinstance(event, engine.Result):
            records.append(row_record(items[rows.start + event.row], event))
        elif isinstance(event, engine.Summary):
            stats = {"first_row": rows.start, **event.stats}
    return Batch(index, rows, records, stats)


def merge(pieces: list[dict], n_batches: int) -> tuple[list[dict], list[dict]]:
    """(row records in input order without their index, each batch's figures in order) from every batch's piece;
    ValueError when a batch is missing or there twice (a merge is only ever asked for once all are done)."""
    by_batch: dict[int, dict] = {}
    for piece in pieces:
        if piece["batch"] in by_batch:
            raise ValueError(f"batch {piece['batch']} was generated twice")
        by_batch[piece["batch"]] = piece
    missing = sorted(set(range(n_batches)) - set(by_batch))
    if missing:
        raise ValueError(f"batches {missing} are missing")
    records, stats = [], []
    for k in range(n_batches):
        records += [{key: v for key, v in row.items() if key != "index"} for row in by_batch[k]["rows"]]
        stats.append(by_batch[k]["stats"])
    return records, stats


def rank_summary(rank: int, batches: list[Batch], wall_s: float, device: str, cuda_peak: int | None) -> dict:
    """What one rank did in this run: rows and tokens generated, its decode rate (decode steps' tokens over their
    time), its memory (the largest KV peak of its batches, its process's peak RSS, CUDA's peak allocation)."""
    new = sum(b.stats["new_tokens"] for b in batches)
    decoded = sum(max(b.stats["new_tokens"] - b.stats["rows"], 0) for b in batches)  # the first token is the prefill's
    decode_s = sum(b.stats["decode_s"] for b in batches)
    out = {"rank": rank, "device": device, "batches": [b.index for b in batches],
           "rows": sum(len(b.rows) for b in batches), "new_tokens": new, "decode_s": round(decode_s, 4),
           "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s > 0 else 0.0,
           "kv_bytes_peak": max((b.stats["kv_bytes_peak"] for b in batches), default=0),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "wall_s": round(wall_s, 2)}
    if cuda_peak is not None:
        out["cuda_max_memory_allocated"] = cuda_peak
    return out


def run_summary(ranks: list[dict], rows: int, earlier_rows: int) -> dict:
    """The whole run in one record: rows in the output, rows generated now and by earlier runs, new tokens, the
    aggregate decode rate (the ranks decode at once, so their rates add), the slowest rank's wall time."""
    return {"rows": rows, "generated_rows": sum(r["rows"] for r in ranks), "earlier_rows": earlier_rows,
            "new_tokens": sum(r["new_tokens"] for r in ranks), "world_size": len(ranks),
            "decode_tokens_per_s": round(sum(r["decode_tokens_per_s"] for r in ranks), 2),
            "wall_s": max((r["wall_s"] for r in ranks), default=0.0)}

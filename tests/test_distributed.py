"""Fast tier: data-parallel `generate` under torchrun, on the tiny model saved as a folder.

- Two ranks write exactly the rows one process writes, in input order, over 17 prompts in batches of 2 (so one batch
  is short), for fadkv and zoomr (full is checked the same way by the kill-and-resume test in test_resume.py). The
  comparison is exact, token ids included: ranks take whole batches of consecutive rows, so every row is decoded in
  the same batch as in one process, and both run on one torch thread.
- More ranks than batches: the idle rank says so and the output is complete.
- A bad input under torchrun is one line, from rank 0, and every rank exits 2 before any model loads (torchrun then
  reports the failed ranks in its own words and exits 1).
- Ranks that do not see the same output folder (node-local storage on several nodes, simulated by giving each rank
  its own folder) are stopped, all of them, with one error.
- The plumbing: torchrun's environment read into a World, the fixed shares, the cost split, agree on one rank.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from kvzip.cli import main
from kvzip.distributed import World, agree, deal, split_by_cost
from kvzip.errors import SharedUserError, UserError
from tests.launch import jsonl, opts, torchrun, write_prompts

ROWS = 17


def generate_args(model_dir, name: str, prompts, out, dict_file=None, new_tokens: int = 24) -> list[str]:
    extra = ["--dict", str(dict_file)] if dict_file is not None else []
    return ["generate", "--model", str(model_dir), "--dtype", "float32", "--method", name, *opts(name), *extra,
            "--input", str(prompts), "--output", str(out), "--batch-size", "2", "--max-new-tokens", str(new_tokens)]


def one_process(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 0


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", ["fadkv", "zoomr"])
def test_two_ranks_write_what_one_process_writes(tmp_path, tiny_model_dir, tiny_dict_file, name):
    prompts = write_prompts(tmp_path / "in.jsonl", ROWS)
    dict_file = tiny_dict_file if name == "fadkv" else None
    one_process(generate_args(tiny_model_dir, name, prompts, tmp_path / "one.jsonl", dict_file))
    got = torchrun(2, *generate_args(tiny_model_dir, name, prompts, tmp_path / "two.jsonl", dict_file))
    assert got.returncode == 0, got.stderr[-3000:]
    *one, _ = jsonl(tmp_path / "one.jsonl")
    *two, summary = jsonl(tmp_path / "two.jsonl")
    assert len(one) == ROWS and two == one  # every field of every row, token ids included, in input order
    assert [r["prompt"] for r in two] == [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    summary = summary["summary"]
    assert summary["method"] == name and summary["totals"]["world_size"] == 2
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1] and all(r["rows"] > 0 for r in summary["ranks"])
    assert {b["rank"] for b in summary["batches"]} == {0, 1}  # both ranks generated
    assert sorted(tmp_path.iterdir()) == sorted(tmp_path / n for n in ("in.jsonl", "one.jsonl", "two.jsonl"))


def test_more_ranks_than_batches_leaves_ranks_idle_and_saying_so(tmp_path, tiny_model_dir):
    prompts = write_prompts(tmp_path / "in.jsonl", 2)
    got = torchrun(3, "generate", "--model", tiny_model_dir, "--dtype", "float32", "--input", prompts, "--output",
                   tmp_path / "out.jsonl", "--batch-size", "1", "--max-new-tokens", "2")
    assert got.returncode == 0, got.stderr[-3000:]
    assert "rank 2: idle: 2 batch(es) of 1 rows left for 3 ranks" in got.stderr
    *rows, summary = jsonl(tmp_path / "out.jsonl")
    assert len(rows) == 2 and summary["summary"]["totals"]["world_size"] == 3
    assert [r["rows"] for r in summary["summary"]["ranks"]] == [1, 1, 0]


def test_a_bad_input_under_torchrun_is_one_line_from_rank_0(tmp_path):
    prompts = write_prompts(tmp_path / "in.jsonl", 4)
    got = torchrun(2, "generate", "--model", tmp_path / "no-such-model", "--input", prompts)  # no --output
    errors = [line for line in got.stderr.splitlines() if line.startswith("kvzip: error:")]
    assert errors == ["kvzip: error: 2 ranks write one merged file: give --output FILE, a path every rank can reach"]
    # rank 0 exits 2 (rank 1 too, unless torchrun stops it first); the model, which does not exist, was never looked at
    assert "exitcode  : 2" in got.stderr and got.returncode != 0 and "unknown model" not in got.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_sees_its_own_folder(rank: int, port: int, root: str, queue) -> None:
    """Rank `rank` of two, given a folder of its own where the output should be shared."""
    from pathlib import Path

    import torch.distributed as dist

    from kvzip.cli.resume import prepare_parts
    from kvzip.runs import Parts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    output = Path(root) / f"node{rank}" / "out.jsonl"
    try:
        prepare_parts(World(rank, 2, 0), Parts(Path(f"{output}.parts")), {"k": 1}, "c", False, output,
                      lambda path: None, "run1")
        queue.put((rank, None))
    except SharedUserError as exc:
        queue.put((rank, (str(exc), exc.speaker)))
    finally:
        dist.destroy_process_group()


def test_ranks_that_see_different_output_folders_are_stopped(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_sees_its_own_folder, args=(r, port, str(tmp_path), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    outcome = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    message = f"rank 1: --output: {tmp_path}/node1/out.jsonl.parts is not the folder rank 0 wrote"
    assert outcome[0][0].startswith(message) and outcome[1][0] == outcome[0][0]
    assert outcome[0][1] is True and outcome[1][1] is False  # rank 0 says it, rank 1 exits quietly


def test_world_from_torchrun_environment():
    assert World.from_env({}) == World(0, 1, 0)
    assert World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == World(3, 4, 1)
    for env, message in (({"WORLD_SIZE": "2"}, "RANK or LOCAL_RANK is missing"),
                         ({"RANK": "2", "WORLD_SIZE": "2"}, "outside a world of 2")):
        with pytest.raises(UserError, match=message):
            World.from_env(env)
    assert World(1, 2, 1).device(torch.device("cpu")) == torch.device("cpu")


def test_shares_are_fixed_and_cover_everything_once():
    items = list(range(11))
    shares = [deal(items, World(r, 3)) for r in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]] and deal(items, World()) == items
    costs = [5, 1, 1, 1, 4, 4]
    parts = [split_by_cost(costs, World(r, 2)) for r in range(2)]
    assert parts == [[0, 1, 2, 3], [4, 5]]  # contiguous, 8 and 8
    assert sorted(sum(([*split_by_cost(costs, World(r, 4))] for r in range(4)), [])) == list(range(6))
    assert [split_by_cost([1, 1], World(r, 3)) for r in range(3)] == [[0], [], [1]]  # more ranks than items


def test_agree_in_a_world_of_one():
    assert agree(World(), lambda: 7) == 7

    def bad():
        raise UserError("no")

    with pytest.raises(SharedUserError, match="^no$") as exc:
        agree(World(), bad, words=str)
    assert exc.value.speaker

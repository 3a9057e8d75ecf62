"""The prefix benchmark's own arithmetic: the BPE counting, each call's reusable prefix.

The benchmark itself is never run here (it measures; tests never time anything).
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

training_prefix = load_bench("training_prefix")


def _rank_file(path: Path, tokens: list[bytes]) -> Path:
    path.write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens)), encoding="ascii"
    )
    return path


def test_pieces_merge_lowest_rank_first_and_specials_are_one_id(tmp_path: Path) -> None:
    price = "价".encode()  # three bytes, merged in two steps
    # bytes first, then merges; "bc" outranks "ab", and "abc" has no rank of its own
    tokens = [b"a", b"b", b"c", b" ", b"\n", b"bc", b"ab", *(price[i : i + 1] for i in range(3)), price[:2], price]
    bpe = training_prefix.RankBPE.load(_rank_file(tmp_path / "ranks", tokens))
    a, space, newline, bc, ab, chinese = 0, 3, 4, 5, 6, 11
    assert bpe.encode("ab") == [ab]
    assert bpe.encode("abc") == [a, bc]
    assert bpe.encode("abc ab") == [a, bc, space, ab]  # " ab" is one piece of the pre-tokenizer
    special = len(tokens)
    assert bpe.encode("<|im_start|>ab<|im_end|>\n") == [special + 1, ab, special + 2, newline]
    assert bpe.encode(" 价") == [space, chinese]  # " " + "价" has no rank of its own


def test_a_bad_rank_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ranks"
    path.write_text("YQ== 0\nnot-base64! 1\n", encoding="ascii")
    with pytest.raises(SystemExit, match=r"ranks:2: not a tiktoken rank line"):
        training_prefix.RankBPE.load(path)


def test_each_call_reuses_its_common_prefix_with_the_previous_call() -> None:
    prompts = [[1, 2, 3], [1, 2, 3, 9, 4, 5], [7, 2, 3]]
    replies = [[9], [6], [8]]
    stable = [[1, 2], [1, 2, 9, 4], [1, 2, 4, 6, 5]]
    rows = training_prefix._call_lengths(prompts, replies, stable)
    assert rows == [
        {"prompt": 3, "cached": 0, "ideal": 0, "stable_prompt": 2, "stable_cached": 0},
        {"prompt": 6, "cached": 4, "ideal": 4, "stable_prompt": 4, "stable_cached": 3},
        {"prompt": 3, "cached": 0, "ideal": 7, "stable_prompt": 5, "stable_cached": 2},
    ]

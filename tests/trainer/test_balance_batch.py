"""``trainer.balance_batch``: the order that gives every data-parallel rank about the same tokens."""

from __future__ import annotations

import random

from rlplat.trainer import balanced_order


def chunk_loads(tokens, order, parts):
    size = len(order) // parts
    return [sum(tokens[row] for row in order[i * size:(i + 1) * size]) for i in range(parts)]


def test_a_long_tail_batch_is_spread_evenly_over_the_ranks():
    generator = random.Random(0)
    tokens = [min(400, int(generator.lognormvariate(3.7, 0.7))) for _ in range(256)]
    for parts in (2, 4, 8):
        order = balanced_order(tokens, parts)
        assert sorted(order) == list(range(256))
        loads = chunk_loads(tokens, order, parts)
        assert max(loads) / (sum(loads) / parts) < 1.01
        naive = chunk_loads(tokens, list(range(256)), parts)
        assert max(loads) <= max(naive)


def test_rows_that_do_not_split_evenly_or_one_rank_keep_their_order():
    assert balanced_order([3, 1, 2], 2) is None
    assert balanced_order([3, 1, 2, 5], 1) is None
    assert balanced_order([], 2) == []

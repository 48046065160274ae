"""R3.1: the batching policy, as a pure function."""

from __future__ import annotations

from vllm_srun.runtime.batching import PendingRow, length_bucket, next_batch


def rows(*lengths: int) -> list[PendingRow]:
    return [PendingRow(request_id=i, index=0, length=n) for i, n in enumerate(lengths)]


def test_buckets_are_powers_of_two_from_8():
    assert [length_bucket(n) for n in (1, 8, 9, 16, 17, 200, 256)] == [8, 8, 16, 16, 32, 256, 256]


def test_oldest_row_chooses_the_bucket_and_order_is_kept():
    batch = next_batch(rows(40, 5, 33, 7, 64, 60), max_num_seqs=32, max_num_batched_tokens=8192)
    assert [r.length for r in batch] == [40, 33, 64, 60]


def test_max_num_seqs_bounds_rows():
    batch = next_batch(rows(*[10] * 50), max_num_seqs=16, max_num_batched_tokens=8192)
    assert len(batch) == 16 and batch[0].request_id == 0


def test_max_num_batched_tokens_bounds_padded_tokens():
    batch = next_batch(rows(200, 250, 180, 256), max_num_seqs=32, max_num_batched_tokens=600)
    assert [r.length for r in batch] == [200, 250]  # 3 x 250 would be 750
    assert len(batch) * max(r.length for r in batch) <= 600


def test_a_row_longer_than_the_token_budget_still_runs_alone():
    assert [r.length for r in next_batch(rows(300), 32, 256)] == [300]

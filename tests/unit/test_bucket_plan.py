"""The bucketed optimizer's bucket plan: order kept, sizes reached, padding to the shard count, tied last."""

import pytest

from ppctl.optim.bucketed import Bucket, plan_buckets


@pytest.mark.parametrize("bucket_size, num_shards", [(1, 1), (10, 2), (25, 3), (1000, 4), (7, 8)])
def test_buckets_cover_every_parameter_once_in_order_padded_to_the_shards(bucket_size, num_shards):
    sizes, late = [12, 5, 30, 1, 8, 9], [False, False, False, False, True, False]
    plan = plan_buckets(sizes, late, bucket_size, num_shards)
    members = [index for _start, _end, group in plan for index in group]
    assert members == [0, 1, 2, 3, 5, 4]  # the late (tied) parameter alone at the end
    assert plan[-1][2] == [4]
    previous_end = 0
    for start, end, group in plan:
        assert start == previous_end and (end - start) % num_shards == 0
        used = sum(sizes[index] for index in group)
        assert used <= end - start < used + num_shards
        previous_end = end
    for _start, _end, group in plan[:-2]:  # every closed bucket reached the size
        assert sum(sizes[index] for index in group) >= bucket_size


def test_shards_split_a_bucket_evenly():
    bucket = Bucket(index=0, start=10, end=22, slots=[])
    assert [bucket.shard(rank, 3) for rank in range(3)] == [(10, 14), (14, 18), (18, 22)]

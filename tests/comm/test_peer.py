"""The peer-copy backend (comm/peer.py): the backend-independent exactness cases of
tests/collective_cases.py, run on peer-copy as tests/comm/test_hccl.py and test_nccl.py run
them on the ctypes backends.
"""

import pytest

from tests.collective_cases import (test_all_reduce_16bit_within_rounding,  # noqa: F401
                                    test_all_reduce_fp32_exact, test_all_reduce_int32,
                                    test_exchange_matches_cat, test_exchange_with_empty_shards,
                                    test_failing_rank_ends_the_run_fast,
                                    test_many_collectives_in_a_row_stay_in_step,
                                    test_non_contiguous_shards,
                                    test_exchange_with_the_shard_plan_matches_cat,
                                    test_a_shard_plan_that_does_not_fit_fails_on_every_rank,
                                    test_one_host_sync_and_one_barrier_per_exchange_with_the_plan,
                                    test_one_host_sync_and_one_barrier_per_all_to_all_with_a_plan)


@pytest.fixture
def backend():
    return "peer"

"""Sizing a lab's ops for a cache (labsim.experiments.roofline)."""

from labsim.experiments.roofline import in_cache_numel, main_memory_numel


def test_an_in_cache_add_fills_at_most_three_quarters_of_the_cache():
    for cache in (256 * 1024, 1024 * 1024, 2 * 1024 * 1024, 1280 * 1024):
        numel = in_cache_numel(cache)
        assert numel & (numel - 1) == 0  # a power of two
        assert 12 * numel <= 3 * cache // 4 < 12 * 2 * numel  # the largest that fits
    assert in_cache_numel(4096) == 2**10  # never below 2^10
    assert in_cache_numel(None) == 2**14


def test_a_main_memory_copy_goes_well_past_the_last_level_cache():
    for l3 in (8 * 2**20, 32 * 2**20):
        assert 4 * main_memory_numel(l3) >= 2 * l3
    assert main_memory_numel(None) == 2**24

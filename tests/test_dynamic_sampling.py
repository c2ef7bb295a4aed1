"""DAPO dynamic sampling on one rank: filtering, refill rounds, the cap and trimming."""
import logging

from yatt.controller.dynamic_sampling import DynamicSampler, informative, trim_quotas


def test_informative_groups_have_unequal_rewards():
    assert informative([0.0, 1.0, 1.0]) and informative([0.2, 0.3])
    assert not informative([1.0, 1.0]) and not informative([0.0] * 4) and not informative([])


def test_trim_quotas_take_from_the_fullest_ranks():
    assert trim_quotas([5, 1, 3], 6) == [3, 1, 2]
    assert trim_quotas([2, 2], 10) == [2, 2]  # short of the target: keep everything
    assert trim_quotas([0, 4, 4], 4) == [0, 2, 2]
    assert sum(trim_quotas([7, 3, 9, 0], 11)) == 11


def _rounds(*rounds):
    """draw(r) returns the r-th of ``rounds``: each a list of reward lists; groups are (round, index)."""
    def draw(r):
        return [(r, i) for i in range(len(rounds[r]))], rounds[r]
    return draw


def test_refills_until_the_batch_is_full_then_trims():
    draw = _rounds([[1, 1], [0, 1]], [[0, 0], [1, 1]], [[0, 1], [1, 0], [0.5, 0.2]], [[0, 1]] * 9)
    sampler = DynamicSampler(target=3, max_rounds=5)
    groups, rewards, stats = sampler.fill(*draw(0), draw)
    assert groups == [(0, 1), (2, 0), (2, 1)] and rewards == [[0, 1], [0, 1], [1, 0]]
    assert stats["dynamic_sampling_rounds"][0] == 2 and stats["dynamic_sampling_groups_dropped"][0] == 3
    assert stats["dynamic_sampling_groups_trimmed"][0] == 1 and stats["dynamic_sampling_cap_hit"][0] == 0


def test_cap_trains_on_the_smaller_batch_with_a_warning_and_counter(caplog):
    draw = _rounds([[1, 1], [0, 1]], [[0, 0]], [[1, 1]], [[0, 1]])
    sampler = DynamicSampler(target=4, max_rounds=2)
    with caplog.at_level(logging.WARNING, logger="yatt"):
        groups, _, stats = sampler.fill(*draw(0), draw)
    assert groups == [(0, 1)]  # round 3 would have helped, but the cap is 2 extra rounds
    assert stats["dynamic_sampling_rounds"][0] == 2 and stats["dynamic_sampling_cap_hit"][0] == 1
    assert "training on the smaller batch" in caplog.text
    sampler.fill([], [], _rounds([], [], []))
    assert sampler.cap_hits == 2
    no_extra = DynamicSampler(target=1, max_rounds=0).fill(*draw(1), draw)
    assert no_extra[0] == [] and no_extra[2]["dynamic_sampling_rounds"][0] == 0


def test_ranks_agree_on_rounds_and_cap_under_mpirun(mpirun):
    proc = mpirun(["tests/mpi/dynamic_sampling.py"], 2, timeout=120)
    assert proc.stdout.count("dynamic sampling OK") == 2

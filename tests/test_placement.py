"""Placement: role plans, the ternary split search, and the async streaming path under mpirun."""
from __future__ import annotations

import math
import random

import pytest

from yatt.config import ConfigError, load_config
from yatt.placement.plan import plan_roles, route
from yatt.placement.search import SplitSearch

GENRM_RECIPE = "configs/grpo_smollm2_genrm.yaml"


# ---------------------------------------------------------------- role plans
def test_roles_per_mode():
    co = plan_roles("colocate", 4)
    assert co.samplers == co.judges == co.trainers == (0, 1, 2, 3) and not co.split
    pa = plan_roles("partial_colocate", 4, 1)
    assert (pa.samplers, pa.judges, pa.trainers) == ((0, 1, 2), (3,), (0, 1, 2, 3)) and pa.split
    di = plan_roles("disaggregated", 4, 2)
    assert (di.samplers, di.judges, di.trainers) == ((0, 1), (2, 3), (0, 1))
    ap = plan_roles("rollout_apart", 4, rollout_ranks=1)
    assert (ap.samplers, ap.judges, ap.trainers) == ((3,), (3,), (0, 1, 2)) and ap.apart and not ap.split


def test_rollout_apart_pairs_each_sampler_with_one_trainer():
    from yatt.placement.push import pairs_of

    roles = plan_roles("rollout_apart", 5, rollout_ranks=3)  # trainers (0, 1), samplers (2, 3, 4)
    assert [pairs_of(roles, r) for r in range(5)] == [([2, 4], None), ([3], None), ([], 0), ([], 1), ([], 0)]
    with pytest.raises(ValueError, match="rollout_ranks"):
        plan_roles("rollout_apart", 4, rollout_ranks=4)


def test_prompts_spread_over_samplers_and_owned_by_trainers():
    roles = plan_roles("disaggregated", 4, 1)
    per_sampler = [sum(roles.sampler_of(g) == s for g in range(24)) for s in roles.samplers]
    assert per_sampler == [8, 8, 8]
    assert roles.owner_of(5, origin=1) == 1  # a trainer trains on what it drew
    assert roles.owner_of(19, origin=3) in roles.trainers  # a GenRM rank's prompts go to a trainer
    partial = plan_roles("partial_colocate", 4, 1)
    assert all(partial.owner_of(g, origin=g // 6) == g // 6 for g in range(24))


@pytest.mark.parametrize("k", [0, 4, 7])
def test_split_modes_need_a_proper_split(k):
    with pytest.raises(ValueError, match="genrm_ranks"):
        plan_roles("partial_colocate", 4, k)


def test_route_without_mpi_is_identity_on_one_rank():
    assert route({0: [1, 2]}, world=1) == [1, 2]


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, key", [
    (["placement.mode=partial_colocate", "reward.type=rule"], "placement.mode"),
    (["placement.genrm_ranks=auto"], "placement.genrm_ranks"),
    (["placement.genrm_ranks=0"], "placement.genrm_ranks"),
    (["placement.mode=disaggregated", "trainer.tp=3"], "trainer.tp"),
    (["placement.mode=disaggregated", "trainer.pp=2"], "trainer.pp"),
    (["placement.mode=split"], "placement.mode"),
    (["placement.trainer_judge_share=0.5"], "placement.trainer_judge_share"),  # colocate: nothing to share
    (["placement.mode=rollout_apart", "placement.trainer_judge_share=0.5", "reward.type=rule"],
     "placement.trainer_judge_share"),  # no judge
    (["placement.mode=rollout_apart", "placement.trainer_judge_share=0.5", "algo.dynamic_sampling=true"],
     "placement.trainer_judge_share"),  # refills need every score on the samplers
    (["placement.mode=rollout_apart", "placement.trainer_judge_share=1"], "placement.trainer_judge_share"),
])
def test_bad_placement_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(GENRM_RECIPE, overrides)


def test_auto_split_config():
    cfg = load_config(GENRM_RECIPE, ["placement.mode=partial_colocate", "placement.genrm_ranks=auto"])
    assert cfg.placement.genrm_ranks == "auto"


# ---------------------------------------------------------------- ternary search
def _run_search(cost, lo, hi, repeats=1, noise=0.0, seed=0, max_steps=200):
    rng = random.Random(seed)
    search, steps = SplitSearch(lo, hi, repeats), 0
    while search.best is None:
        k = search.next()
        assert lo <= k <= hi
        search.record(k, cost(k) + rng.gauss(0, noise))
        steps += 1
        assert steps < max_steps, "search did not converge"
    assert search.next() == search.best  # stays on the chosen split
    return search.best, steps


@pytest.mark.parametrize("opt", [1, 2, 7, 16, 30, 31])
def test_ternary_search_finds_the_minimum_of_a_unimodal_cost(opt):
    best, steps = _run_search(lambda k: (k - opt) ** 2 + 3.0, 1, 31)
    assert best == opt
    assert steps <= 2 * math.ceil(math.log(31, 1.5)) + 3  # logarithmic, not a sweep of 31


def test_ternary_search_on_a_phase_time_shape():
    # k GenRM ranks of 16: judging takes 130/k, sampling 60/(16-k): the phase waits for the slower.
    cost = lambda k: max(130 / k, 60 / (16 - k))  # noqa: E731
    best, _ = _run_search(cost, 1, 15)
    assert best == min(range(1, 16), key=cost) == 11


def test_ternary_search_with_noise_and_repeats():
    hits = sum(_run_search(lambda k: abs(k - 9) * 1.0, 1, 20, repeats=3, noise=0.2, seed=s)[0] in (8, 9, 10)
               for s in range(20))
    assert hits >= 18


def test_ternary_search_on_a_plateau_and_single_candidate():
    best, _ = _run_search(lambda k: 5.0 if 4 <= k <= 8 else 5.0 + abs(k - 6), 1, 12)
    assert 4 <= best <= 8
    assert SplitSearch(1, 1).next() == 1  # world 2: one possible split, no search
    with pytest.raises(ValueError):
        SplitSearch(3, 2)


# ---------------------------------------------------------------- async streaming under mpirun
@pytest.mark.parametrize("args", [["1"], ["3"], ["2", "1"]], ids=["1-genrm", "3-genrm", "2-genrm-one-slow"])
def test_streaming_delivers_every_group_exactly_once(mpirun, args):
    """Samplers finish groups in shuffled order; every group is scored once and reaches its owner."""
    proc = mpirun(["tests/mpi/stream_exactly_once.py", *args], ranks=4, timeout=300)
    assert "OK" in proc.stdout


def test_launch_rejects_split_placement_without_mpi_or_room(mpirun, tmp_path):
    import subprocess
    import sys

    args = ["-m", "yatt.launch", "--config", GENRM_RECIPE, "placement.mode=partial_colocate",
            f"output_dir={tmp_path / 'run'}"]
    single = subprocess.run([sys.executable, *args, "--standalone"], capture_output=True, text=True, timeout=120)
    assert single.returncode == 2 and "placement.mode" in single.stderr and "mpirun" in single.stderr
    with pytest.raises(AssertionError, match="placement.genrm_ranks"):  # 2 GenRM ranks leave no sampler
        mpirun([*args, "placement.genrm_ranks=2"], ranks=2, timeout=120)
    assert not (tmp_path / "run").exists()  # rejected before anything was written


def test_auto_split_resplits_the_world_until_the_search_settles(mpirun):
    proc = mpirun(["tests/mpi/auto_split.py"], ranks=4, timeout=300)
    assert "OK" in proc.stdout


# ---------------------------------------------------------------- engine slots (release between phases)
class _RecordingEngine:
    """Records the calls a slot makes; ``can_sleep`` picks GPU (sleep) or CPU (teardown) release."""

    def __init__(self, log: list, can_sleep: bool):
        self.log, self.can_sleep = log, can_sleep
        log.append("build")

    def sleep(self):
        self.log.append("sleep")

    def wake_up(self):
        self.log.append("wake_up")

    def shutdown(self):
        self.log.append("shutdown")


@pytest.mark.parametrize("can_sleep, expected", [
    (False, ["build", "shutdown", "build", "shutdown"]),  # CPU: release = teardown, wake = rebuild
    (True, ["build", "sleep", "wake_up", "sleep", "shutdown"]),  # GPU: built once, slept and woken
])
def test_engine_slot_releases_by_sleep_or_teardown(can_sleep, expected):
    from yatt.placement.slots import EngineSlot

    log: list = []
    slot = EngineSlot(lambda: _RecordingEngine(log, can_sleep))
    assert slot.wake() is slot.wake()  # waking an awake engine is a no-op
    slot.sleep()
    slot.sleep()  # idempotent
    slot.wake()
    slot.sleep()
    slot.close()
    assert log == expected
    assert slot.obj is None and not slot.asleep


def test_engine_slot_reaches_the_engine_inside_a_judge():
    from types import SimpleNamespace

    from yatt.placement.slots import EngineSlot

    log: list = []
    slot = EngineSlot(lambda: SimpleNamespace(engine=_RecordingEngine(log, True)))
    slot.build_now()
    slot.sleep()
    assert slot.asleep and log == ["build", "sleep"]


# ---------------------------------------------------------------- engines resident (CPU)
GIB = 2**30


def test_engines_stay_resident_only_where_every_machine_keeps_its_reserve():
    from yatt.placement.residency import engines_fit

    # two ranks per machine, 1 GiB of engines each; 16 GiB machines: 10% = 1.6 GiB must stay free.
    # Each low point already counts its own rank's engines; the other rank's come off it.
    fit, account = engines_fit([("a", GIB, 2.7 * GIB, 16 * GIB), ("a", GIB, 2.9 * GIB, 16 * GIB)])
    assert fit and account == "a: 2.00 GiB of engines, 1.7 of 16.0 GiB left with them at the step's low point"
    assert not engines_fit([("a", GIB, 2.5 * GIB, 16 * GIB), ("a", GIB, 2.9 * GIB, 16 * GIB)])[0]  # lowest counts
    # one machine short is enough to release everywhere
    assert not engines_fit([("a", GIB, 8 * GIB, 16 * GIB), ("b", GIB, 1.5 * GIB, 16 * GIB)])[0]
    assert engines_fit([("a", 0, 1.7 * GIB, 16 * GIB)])[0]


@pytest.mark.parametrize("keep, expected", [
    ("never", ["build rollout"] + ["shutdown rollout", "build judge", "shutdown judge", "build rollout"] * 2),
    ("always", ["build rollout", "build judge"]),  # built once, kept
    ("auto", ["build rollout", "shutdown rollout", "build judge", "shutdown judge", "build rollout",  # measured
              "build judge"]),  # then kept: the step's low point left the whole machine free
])
def test_colocated_engines_are_released_or_kept(keep, expected):
    """Colocate with a GenRM judge on CPU: per step, rollout, judge, then the weight push."""
    from types import SimpleNamespace

    import psutil

    from yatt.placement.runner import Placement

    log: list = []

    class Engine(_RecordingEngine):
        def __init__(self, name):
            self.name = name
            super().__init__(log, False)
            log[-1] = f"build {name}"

        def shutdown(self):
            log.append(f"shutdown {self.name}")

        def generate(self, prompts, spec):
            return [[] for _ in prompts]

        def update_weights(self, weights, shards=False):
            list(weights)

    cfg = SimpleNamespace(placement=SimpleNamespace(mode="colocate", genrm_ranks=1, rollout_ranks=1, auto_repeats=1, keep_engines=keep),
                          trainer=SimpleNamespace(sync_bucket_mb=1), rollout=SimpleNamespace(tp=1), seed=0)
    scorer = SimpleNamespace(uses_judge=True, make_judge=lambda seed, tp: SimpleNamespace(engine=Engine("judge"), seed=0),
                             judge_groups=lambda judge, groups: None)
    actor = SimpleNamespace(export_hf_weights=lambda bucket, shard: iter([]))
    placement = Placement(cfg, 0, 1, build_rollout=lambda: Engine("rollout"), scorer=scorer, decode=str, gpu=False)
    placement.start()
    for _ in range(2):
        placement.rollout_and_score([SimpleNamespace(prompt_ids=[1])], SimpleNamespace(seed=0), actor)
        placement.sync(actor)
        placement.end_step(1.0, avail_min=psutil.virtual_memory().total)
    assert log == expected

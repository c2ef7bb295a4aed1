"""Outcome advantage estimators by name (yatt/algos/estimators.py) and their config keys."""
import pytest
import torch

from yatt.algos.estimators import ESTIMATORS, advantages, estimator_for, get_estimator, register
from yatt.config import ESTIMATOR_NAMES, ConfigError, load_config
from yatt.launch import _check_estimator

RECIPE = "configs/grpo_smollm2.yaml"
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0],   # two right, two wrong
                        [1.0, 0.0, 0.0, 0.0],   # one right
                        [0.5, 0.5, 0.5, 0.5]])  # all equal: no signal


def test_grpo_dr_grpo_and_rloo_by_their_equations():
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as GRPO's reference code
    torch.testing.assert_close(get_estimator("grpo")(REWARDS)[0], (torch.tensor([1.0, 0.0, 0.0, 1.0]) - 0.5) / (std + 1e-6))
    torch.testing.assert_close(get_estimator("dr_grpo")(REWARDS)[1], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # RLOO: r_i minus the mean of the other three
    torch.testing.assert_close(get_estimator("rloo")(REWARDS)[1], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    torch.testing.assert_close(get_estimator("rloo")(REWARDS)[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    for name in ("grpo", "dr_grpo", "rloo"):
        adv = get_estimator(name)(REWARDS)
        assert adv.dtype == torch.float32 and torch.equal(adv[2], torch.zeros(4)), name  # equal rewards: exactly 0
        torch.testing.assert_close(adv.sum(dim=-1), torch.zeros(3)), name  # every baseline is the group's own
    with pytest.raises(ValueError, match="rloo needs at least 2 samples"):
        get_estimator("rloo")(torch.ones(3, 1))
    assert estimator_for("grpo", norm_adv_by_std=False) is ESTIMATORS["dr_grpo"]


def centred_sign(rewards: torch.Tensor) -> torch.Tensor:
    """A user's estimator for the test: the sign of reward minus the group mean."""
    return torch.sign(rewards - rewards.mean(dim=-1, keepdim=True))


def test_a_users_estimator_by_import_path_and_its_output_checked():
    fn = get_estimator("test_estimators:centred_sign")
    assert fn is centred_sign and torch.equal(advantages(fn, REWARDS)[1], torch.tensor([1.0, -1.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match=r"algo.estimator returned \(3,\) for rewards of shape \(3, 4\)"):
        advantages(lambda r: r.sum(-1), REWARDS)
    with pytest.raises(ValueError, match="non-finite"):
        advantages(lambda r: r / 0, REWARDS)
    with pytest.raises(ValueError, match="already registered"):
        register("grpo")(centred_sign)


@pytest.mark.parametrize("overrides, message", [
    (["algo.estimator=ppo"], "algo.estimator: unknown estimator 'ppo'; one of ['dr_grpo', 'gae', 'grpo', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo']"),
    (["algo.estimator=mypkg.mod.fn"], "algo.estimator: unknown estimator 'mypkg.mod.fn'"),
    (["algo.estimator=rloo", "rollout.n=1"], "rollout.n: the rloo advantage is group-relative"),
    (["algo.estimator=rloo", "algo.norm_adv_by_std=false"], "algo.norm_adv_by_std: read by algo.estimator=grpo only"),
])
def test_estimator_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(RECIPE, overrides)
    assert load_config(RECIPE, ["algo.estimator=rloo"]).algo.estimator == "rloo"


def test_the_config_lists_the_registered_names_and_a_job_loads_a_users_function_at_start():
    assert set(ESTIMATOR_NAMES) == set(ESTIMATORS)  # config.py validates names without importing torch
    cfg = load_config(RECIPE, ["algo.estimator=nosuchpkg.mod:fn"])  # well-formed: loaded when the job starts
    with pytest.raises(ConfigError, match="algo.estimator: cannot load 'nosuchpkg.mod:fn'"):
        _check_estimator(cfg)
    _check_estimator(load_config(RECIPE, ["algo.estimator=test_estimators:centred_sign"]))


def test_reward_normalisation_group_batch_and_clip():
    from yatt.algos.reward_norm import normalize_rewards

    rewards = [[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]]
    assert normalize_rewards(rewards, "none") == rewards
    group = torch.tensor(normalize_rewards(rewards, "group"))
    g0 = torch.tensor(rewards[0])
    torch.testing.assert_close(group[0], ((g0 - g0.mean()) / (g0.std() + 1e-6)))
    assert group[1].eq(0).all()  # a tie stays a tie: no signal is made up
    flat = torch.tensor(rewards).flatten()
    batch = torch.tensor(normalize_rewards(rewards, "batch"))
    torch.testing.assert_close(batch.flatten(), (flat - flat.mean()) / (flat.std() + 1e-6))
    clipped = torch.tensor(normalize_rewards(rewards, "none", clip=1.5))
    assert clipped.max() == 1.5 and clipped[2, 1] == 1.0
    assert torch.tensor(normalize_rewards(rewards, "batch", clip=1.0)).abs().max() == 1.0
    assert normalize_rewards([], "batch") == [] and normalize_rewards([], "group") == []
    with pytest.raises(ValueError, match="algo.reward_norm: unknown mode 'rank'"):
        normalize_rewards(rewards, "rank")
    cfg = load_config(RECIPE, ["algo.reward_norm=batch", "algo.reward_clip=5"])
    assert cfg.algo.reward_norm == "batch" and cfg.algo.reward_clip == 5.0
    with pytest.raises(ConfigError, match="algo.reward_norm: group whitens each prompt's rewards"):
        load_config(RECIPE, ["algo.reward_norm=group", "algo.estimator=reinforce_pp", "rollout.n=1"])

from pathlib import Path

import pytest

from yatt.config import Config, ConfigError, load_config

RECIPE = "configs/grpo_smollm2.yaml"


def test_recipe_loads_and_overrides_apply(tmp_path):
    cfg = load_config(RECIPE, ["trainer.total_steps=3", f"output_dir={tmp_path}", "rollout.temperature=0.5"])
    assert cfg.trainer.total_steps == 3 and isinstance(cfg.trainer.total_steps, int)
    assert cfg.output_dir == str(tmp_path)
    assert cfg.rollout.temperature == 0.5


@pytest.mark.parametrize("recipe", sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")), ids=lambda p: p.name)
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe, [])
    assert cfg.trainer.total_steps > 0 and cfg.output_dir.startswith("runs/")


@pytest.mark.parametrize("override, expected", [
    ("trainer.total_stepz=2", "unknown config key 'trainer.total_stepz' (did you mean 'trainer.total_steps'?)"),
    ("trainr.lr=1e-6", "unknown config key 'trainr' (did you mean 'trainer'?)"),
    ("trainer.total_steps=two", "config key 'trainer.total_steps'"),
    ("rollout.top_p=1.5", "config key 'rollout.top_p'"),
    ("algo.kl_estimator=k4", "config key 'algo.kl_estimator'"),
    ("data.source=file", "data.train_files: required"),
    ("trainer.balance.cost_linear=0", "trainer.balance.cost_linear: cost_linear and cost_quadratic are both 0"),
    ("trainer.balance.cost_quadratic=-1", "config key 'trainer.balance.cost_quadratic'"),
    ("trainer.guard.spike_factor=1", "config key 'trainer.guard.spike_factor'"),
    ("trainer.guard.min_history=30", "trainer.guard.min_history: must not exceed trainer.guard.window"),
])
def test_bad_key_or_type_names_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, [override])
    assert expected in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["trainer.total_steps"])
    with pytest.raises(ConfigError, match="'seed' is not a section"):
        load_config(None, ["seed=1", "seed.x=2"])


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_launch_rejects_bad_config_before_loading_anything():
    import subprocess
    import sys

    # A valid config, every cross-field check included, is validated without torch too: c10 reads
    # its log level (yatt.logs.setup) when torch is first imported.
    code = ("import sys; from yatt.launch import load_config, main; load_config(%r, ['algo.estimator=rloo']); "
            "rc = main(['--config', %r, 'trainer.total_stepz=2']); "
            "assert 'vllm' not in sys.modules and 'megatron.core' not in sys.modules and 'torch' not in sys.modules; "
            "sys.exit(rc)" % (RECIPE, RECIPE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "did you mean 'trainer.total_steps'" in out.stderr


def test_defaults_are_valid():
    assert Config().trainer.total_steps > 0


def test_cross_field_checks_name_the_key():
    with pytest.raises(ConfigError, match="algo.mini_batches"):
        load_config(RECIPE, ["trainer.prompts_per_rank=1", "rollout.n=2", "algo.mini_batches=4"])
    with pytest.raises(ConfigError, match="config key 'rollout.tp'"):
        load_config(RECIPE, ["rollout.tp=0"])
    with pytest.raises(ConfigError, match="rollout.tp: rollout TP > 1 runs with placement.mode=colocate"):
        load_config(RECIPE, ["rollout.tp=2", "placement.mode=rollout_apart"])  # for now
    assert load_config(RECIPE, ["rollout.tp=2", "stage=sft"]).rollout.tp == 2  # its evals' engine
    with pytest.raises(ConfigError, match="rollout.tp: rollout TP > 1"):
        load_config("configs/grpo_smollm2_genrm.yaml", ["rollout.tp=2", "placement.mode=partial_colocate"])
    assert load_config("configs/grpo_smollm2_genrm.yaml", ["rollout.tp=2"]).rollout.tp == 2  # its judge colocated


def test_existing_run_is_not_overwritten_by_accident(tmp_path):
    import subprocess
    import sys

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    out = subprocess.run([sys.executable, "-m", "yatt.launch", "--standalone", "--config", RECIPE, f"output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "already holds a run" in out.stderr and "overwrite=true" in out.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_tensor_parallel_size_must_split_the_heads(tmp_path):
    import subprocess
    import sys

    from yatt.assets.model import SMOLLM2, resolve_model

    smol = resolve_model(SMOLLM2)  # 9 attention heads, 3 KV heads, MLP size 1536
    out = subprocess.run([sys.executable, "-m", "yatt.launch", "--standalone", "--config", RECIPE, f"model.path={smol}",
                          "trainer.tp=2", f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "config key 'trainer.tp': TP=2 must divide the KV heads (3) and the MLP size (1536)" in out.stderr


@pytest.mark.parametrize("override,message", [
    ("trainer.pp=4", "config key 'trainer.pp': PP=4 must divide the number of layers (30)"),
    ("trainer.pp=3", "config keys 'trainer.tp', 'trainer.pp': TP*PP=3 must divide the world size (1)"),
    ("rollout.tp=2", "config key 'rollout.tp': the policy's engine: inference TP=2 must divide the model's heads (9), "
                     "KV heads (3)"),
    ("rollout.tp=2 model=qwen", "config key 'rollout.tp': 2 ranks per rollout engine must divide the world size (1)"),
])
def test_model_parallel_sizes_must_split_the_model_and_the_world(tmp_path, override, message):
    import subprocess
    import sys

    from yatt.assets.model import SMOLLM2, resolve_model
    from yatt.config import GenRMConfig

    override, _, model = override.partition(" model=")  # SmolLM2: 30 layers, 9 heads; Qwen2.5-0.5B: 14 heads, 2 KV heads
    path = resolve_model(GenRMConfig().model if model else SMOLLM2)
    out = subprocess.run([sys.executable, "-m", "yatt.launch", "--standalone", "--config", RECIPE, f"model.path={path}",
                          override, f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert message in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("overrides, expected", [
    (["rollout.n=1"], "rollout.n: the grpo advantage is group-relative"),
    (["rollout.n=1", "algo.dynamic_sampling=true"], "rollout.n: the grpo advantage is group-relative"),
    (["algo.dynamic_sampling=true", "trainer.balance.enabled=false"], "needs trainer.balance.enabled"),
])
def test_recipes_that_cannot_learn_are_refused(overrides, expected):
    """Refused when the recipe is read, before any model loads, naming the key."""
    with pytest.raises(ConfigError, match=expected):
        load_config(RECIPE, overrides)
    assert load_config(RECIPE, ["algo.dynamic_sampling=true"]).algo.max_sampling_rounds == 2

"""``from yatt import Trainer``: arguments map onto the typed config (its run under mpirun: test_e2e)."""
import pytest

from yatt import Trainer
from yatt.config import ConfigError


def test_arguments_map_onto_the_config():
    t = Trainer(actor_model="smollm2-135m-instruct", strategy="colocate", trainer__lr=2e-5,
                overrides={"output_dir": "/tmp/api_run"})
    c = t.config(dataset="basic_arithmetic", batch_size=8, ppo_epochs=2)
    assert (c.model.path, c.placement.mode, c.trainer.lr, c.output_dir) == ("smollm2-135m-instruct", "colocate", 2e-5,
                                                                             "/tmp/api_run")
    assert (c.data.source, c.data.task, c.trainer.prompts_per_rank, c.algo.ppo_epochs) == ("reasoning_gym",
                                                                                          "basic_arithmetic", 8, 2)
    g = Trainer("m", reward_model="qwen2.5-coder-0.5b-instruct", strategy="partial_colocate").config(dataset="d.jsonl")
    assert (g.reward.type, g.reward.genrm.model, g.data.source, g.data.train_files) == (
        "genrm", "qwen2.5-coder-0.5b-instruct", "file", ["d.jsonl"])
    assert Trainer("m", recipe="configs/grpo_smollm2.yaml").config().rollout.n == 8  # the recipe, then the arguments


def test_bad_arguments_name_the_key():
    with pytest.raises(ConfigError, match="strategy"):
        Trainer("m", strategy="fsdp")
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_steps'"):
        Trainer("m", trainer__total_stepz=1).config()
    with pytest.raises(ConfigError, match="algo.ppo_epochs"):
        Trainer("m").config(ppo_epochs=0)



# The API's run under mpirun -np 2: tests/test_e2e.py (tests/mpi/api_train.py).

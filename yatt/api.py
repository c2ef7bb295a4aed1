"""The Python entry: the same job as ``python -m yatt.launch``, configured from a script.

    from yatt import Trainer

    records = Trainer(actor_model="smollm2-135m-instruct", reward_model=None, strategy="colocate",
                      output_dir="runs/api").train(dataset="basic_arithmetic", batch_size=8, ppo_epochs=1)

Run the script under ``mpirun -np N python script.py`` (or ``srun``/torchrun) and it is SPMD:
every rank runs it, each with its shard of the batch; under plain ``python`` it is one rank.
Arguments map onto the typed config (:mod:`yatt.config`), and ``**overrides`` take any other
key in dotted form (``{"trainer.total_steps": 5}``), validated like a recipe's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from yatt.config import Config, ConfigError, load_config

STRATEGIES = ("colocate", "partial_colocate", "disaggregated")  # placement.mode


class Trainer:
    """A GRPO run of ``actor_model`` against a rule reward or a GenRM judge.

    Args:
        actor_model: packaged model name or local Hugging Face folder of the policy.
        reward_model: None for the task's rule reward, else the GenRM judge (packaged name or
            HF folder; ``reward.type`` becomes ``genrm``).
        strategy: placement: ``colocate``, ``partial_colocate`` or ``disaggregated``.
        recipe: a YAML recipe to start from (default: the built-in defaults).
        **overrides: more config keys, dotted (``{"trainer.lr": 1e-5}``) or as keyword
            arguments with ``__`` for dots (``trainer__lr=1e-5``).
    Raises:
        ConfigError: an unknown strategy or a bad key or value (the message names the key).
    """

    def __init__(self, actor_model: str, reward_model: str | None = None, strategy: str = "colocate",
                 recipe: str | Path | None = None, overrides: dict[str, Any] | None = None, **kwargs: Any):
        if strategy not in STRATEGIES:
            raise ConfigError(f"strategy: {strategy!r} is not one of {sorted(STRATEGIES)}")
        self.recipe = recipe
        self.settings: dict[str, Any] = {"model.path": actor_model, "placement.mode": strategy}
        if reward_model is not None:
            self.settings.update({"reward.type": "genrm", "reward.genrm.model": reward_model})
        self.settings.update(overrides or {})
        self.settings.update({k.replace("__", "."): v for k, v in kwargs.items()})

    def config(self, **train_args: Any) -> Config:
        """The validated config of :meth:`train` with these arguments (no job is started)."""
        settings = dict(self.settings)
        dataset, batch_size, ppo_epochs = (train_args.pop(k, None) for k in ("dataset", "batch_size", "ppo_epochs"))
        if train_args:
            raise ConfigError(f"unknown train() argument(s): {sorted(train_args)}")
        if isinstance(dataset, (str, Path)) and Path(dataset).suffix in (".jsonl", ".parquet"):
            settings.update({"data.source": "file", "data.train_files": [str(dataset)]})
        elif isinstance(dataset, (list, tuple)):
            settings.update({"data.source": "file", "data.train_files": [str(d) for d in dataset]})
        elif dataset is not None:
            settings.update({"data.source": "reasoning_gym", "data.task": str(dataset)})
        if ppo_epochs is not None:
            settings["algo.ppo_epochs"] = ppo_epochs
        if batch_size is not None:
            from yatt.dist import discover

            world = discover().world_size
            if batch_size % world:
                raise ConfigError(f"batch_size: {batch_size} prompts per step do not split over {world} ranks")
            settings["trainer.prompts_per_rank"] = batch_size // world
        return load_config(self.recipe, values=settings)

    def train(self, dataset: str | Path | list | None = None, batch_size: int | None = None,
              ppo_epochs: int | None = None) -> list[dict]:
        """Train (collective: every rank of the job calls it, once per process).

        Args:
            dataset: a reasoning-gym task name, or jsonl/parquet file(s) with ``question`` (or a
                chat ``messages`` list) and ``answer`` fields (``data.question_key``,
                ``data.messages_key`` and ``data.answer_key`` rename them).
            batch_size: prompts per step over all ranks (split evenly: ``trainer.prompts_per_rank``).
            ppo_epochs: passes over each step's rollout batch.
        Returns:
            Rank 0's metric records (as in ``metrics.jsonl``); an empty list on other ranks.
        Raises:
            ConfigError: a bad argument, key or path, or the output folder is another job's;
            RuntimeError: the job stopped with another exit code (75: a SIGTERM/SIGUSR1
            checkpoint was saved, 130: a Ctrl-C's; run again to resume). KeyboardInterrupt: a
            second Ctrl-C (the newest committed checkpoint is intact).
        """
        from yatt.launch import execute

        code, records = execute(self.config(dataset=dataset, batch_size=batch_size, ppo_epochs=ppo_epochs))
        if code == 2:
            raise ConfigError("the config was refused (see the message above)")
        if code:
            raise RuntimeError(f"the run stopped with exit code {code}")
        return records

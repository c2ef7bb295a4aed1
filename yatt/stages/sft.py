"""Supervised fine-tuning (``stage: sft``): the policy learns each row's target response.

A step draws ``trainer.prompts_per_rank`` rows per rank from the same controller shard as RL
(:mod:`yatt.controller.shard`), makes one :class:`~yatt.controller.batch.Sample` per row (the
chat-templated prompt, and the target response's tokens followed by the tokenizer's EOS), packs
and balances them like RL samples and takes one optimizer step on the negative log-likelihood of
the response tokens (:func:`yatt.algos.preference.sft_loss`), its mean over every response token
of the step on every DP rank. The target is a conversation's final assistant turn (a chat row,
``data.messages_key``, that ends with one), else the row's ``sft.response_key`` field, or
``sft.response_template`` with the row's answer; a row without one (an empty one), or too long for
``rollout.max_model_len`` (the evals' engine), is skipped and counted (``sft_rows_skipped``).

A conversation with earlier assistant turns (a tool-use transcript: the model calls a tool, reads
its result, answers) is learnt turn by turn: the prompt is the turns before the first assistant
turn, and the response every turn after it laid out as a multi-turn rollout lays it out
(:mod:`yatt.rollout.episodes`: each assistant turn's tokens and the end-of-turn token, then the
chat template's text of the turns up to the next one), with only the assistant turns in the loss
(``Sample.loss_mask``). So the policy learns the format its ``rollout.env`` episodes sample in.
"""
from __future__ import annotations

from yatt.algos.preference import sft_loss
from yatt.algos.update import mini_batch_norm
from yatt.config import SftConfig
from yatt.controller.batch import Sample


def target_text(row, cfg: SftConfig) -> str | None:
    """The target response of a :class:`~yatt.assets.data.PromptRow`: its conversation's final
    assistant turn (``row.target``), else by ``cfg``; None when it has none (an empty target, or a
    missing, non-string or empty ``response_key`` field)."""
    if (target := getattr(row, "target", None)) is not None:
        return target if target.strip() else None
    if cfg.response_key is None:
        return cfg.response_template.replace("{answer}", row.answer)
    text = row.entry.get(cfg.response_key)
    return text if isinstance(text, str) and text.strip() else None


def sft_samples(rows, cfg: SftConfig, tokenizer, max_len: int) -> tuple[list[Sample], int]:
    """One Sample per row that has a target of at most ``max_len`` tokens with its prompt; returns
    (samples, rows skipped). ``response_ids`` are the target's tokens (no special tokens added)
    and the tokenizer's EOS, so the model learns to stop."""
    samples, skipped = [], 0
    for row in rows:
        text = target_text(row, cfg)
        sample = None if text is None else _turns_sample(row, text, tokenizer)
        if sample is None and text is not None:
            ids = _turn_ids(tokenizer, text)
            sample = Sample(list(row.prompt_ids), ids, [0.0] * len(ids), "stop")
        if sample is None or sample.length > max_len:
            skipped += 1
            continue
        samples.append(sample)
    return samples, skipped


def _turn_ids(tokenizer, text: str) -> list[int]:
    """An assistant turn's tokens as the model writes them: its text's (no special tokens) and EOS."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _turns_sample(row, target: str, tokenizer) -> Sample | None:
    """The multi-turn Sample of a conversation row with assistant turns before its ``target`` (see the
    module docstring), or None when it has none."""
    from yatt.env.template import observation_text

    messages = [*(getattr(row, "messages", None) or []), {"role": "assistant", "content": target}]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if first == len(messages) - 1:
        return None
    history = messages[:first]
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids, mask, i = [], [], first
    while i < len(messages):
        turn, j = messages[i], i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        own = _turn_ids(tokenizer, turn["content"])
        ids, mask = ids + own, mask + [1.0] * len(own)
        if j < len(messages):  # the turns up to the next assistant turn, as the chat template writes them
            text = observation_text(tokenizer, history, turn["content"], messages[i + 1:j],
                                    generated_stop=tokenizer.eos_token)
            obs = tokenizer.encode(text, add_special_tokens=False)
            ids, mask = ids + obs, mask + [0.0] * len(obs)
        history, i = history + messages[i:j], j
    return Sample(list(prompt), ids, [0.0] * len(ids), "stop", loss_mask=mask)


def sft_update(actor, micro_batches: list[dict], dp_group=None) -> dict[str, tuple[float, float]]:
    """One optimizer step on the response tokens' mean negative log-likelihood over ``dp_group``
    (a rank with no micro-batch still takes part). Returns (sum, count) pairs: ``sft_loss`` (nats
    per response token), ``grad_norm`` and ``lr``."""
    tokens = mini_batch_norm(micro_batches, 1, dp_group).tokens

    def loss_fn(logprobs, entropy, mb):
        mask = mb["response_mask"]
        return (sft_loss(logprobs, mask, max(tokens, 1.0)),
                {"nll": -(logprobs.detach() * mask).sum(), "tokens": mask.sum()})

    out = actor.train_step(micro_batches, loss_fn)
    return {"sft_loss": (out.get("nll", 0.0), out.get("tokens", 0.0)), "grad_norm": (out["grad_norm"], 1.0),
            "lr": (out["lr"], 1.0)}

"""Multi-turn rollouts: episodes of model turns and environment observations, in lock-step.

With ``rollout.env`` every sample is an *episode* in an environment of its own (:mod:`yatt.env`):
``env.reset(row)`` gives its first chat messages, the model answers, ``env.step`` reads the
answer and replies (a tool's result, say) or ends the episode, and the model goes on from the
whole conversation. All of a rank's active episodes advance one turn per batched engine call
(:func:`run_episodes`), and their environments step concurrently
(:func:`yatt.env.batch.step_all`).

Token-level: an episode's sequence is built by concatenation, never by re-tokenizing the
conversation: ``prompt + turn_1 + obs_1 + turn_2 + ...``, where each ``turn_k`` is the engine's
sampled tokens (ending with the end-of-turn token) and ``obs_k`` the chat template's text for the
environment's messages after that turn (:func:`yatt.env.template.observation_text`), tokenized on
its own. So the trainer's logprobs over the whole sequence are those of exactly the context the
engine sampled each turn from. The episode comes back as one
:class:`~yatt.rollout.vllm_engine.Completion` whose ``mask`` marks the model's tokens (1) and the
environment's (0): only the model's get loss and advantages.

An episode ends, with its reason recorded (``turns_end_<reason>``), when the environment says
done (``done``), after ``rollout.max_turns`` model turns (``max_turns``), when its tokens after
the prompt would pass ``rollout.episode_max_tokens`` (``token_budget``) or the context would pass
``rollout.max_model_len`` (``context``), when a model turn is cut at ``rollout.max_tokens``
(``length``), or when the environment raises or breaks its contract (``env_error``: the
episode's reward becomes ``rollout.env_error_score``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from yatt.rollout.vllm_engine import Completion, SamplingSpec

log = logging.getLogger("yatt")
END_REASONS = ("done", "max_turns", "token_budget", "context", "length", "env_error")
_TURN_SEED_STRIDE = 7_919_993  # per-turn offset of the request seeds of turns 2, 3, ...


@dataclass
class Episode:
    """One episode in flight: its environment, conversation, prompt and the tokens after it."""

    env: Any
    messages: list[dict]
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    final_ids: list[int] = field(default_factory=list)  # the last model turn's tokens
    turns: int = 0
    env_reward: float = 0.0
    end: str | None = None
    stopped: bool = True  # the last model turn ended on the end-of-turn token
    counters: dict[str, float] = field(default_factory=dict)

    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def completion(self) -> Completion:
        info = {"turns": self.turns, "end": self.end, "env_reward": self.env_reward, **self.counters}
        return Completion(self.token_ids, self.logprobs, "stop" if self.stopped else "length", mask=self.mask,
                          final_ids=self.final_ids, episode=info, prompt_ids=self.prompt_ids)


@dataclass
class Limits:
    """Per-episode limits: model turns, tokens after the prompt (model and environment), context length."""

    max_turns: int
    max_tokens: int
    max_model_len: int


def run_episodes(engine, make_env, rows: list, spec: SamplingSpec, tokenizer, limits: Limits) -> list[list[Completion]]:
    """Roll out ``spec.n`` episodes per row, every active episode one turn per engine call.

    Args:
        engine: a :class:`~yatt.rollout.vllm_engine.VLLMEngine` (``generate``).
        make_env: ``() -> environment``, one per episode (:func:`yatt.env.load_env`'s factory).
        rows: :class:`~yatt.assets.data.PromptRow` list; ``env.reset`` gets each one's ``entry``.
        spec: sampling settings. Each turn's call samples one response per active episode, seeded
            as ``spec`` would seed ``spec.n`` per row at turn 1 (the same request seeds), and from
            ``spec.seed`` and the turn after it.
        tokenizer: the policy's tokenizer (chat template, decoding).
        limits: :class:`Limits`.
    Returns:
        ``out[i][k]``: episode k of row i as one Completion: ``prompt_ids`` the chat template of
        ``env.reset``'s messages, ``token_ids`` every token after it, ``logprobs`` the engine's for
        model tokens (0.0 for the environment's), ``mask`` 1/0 per token (model/environment),
        ``final_ids`` the last model turn, ``episode`` its info (``turns``, ``end`` reason,
        ``env_reward``, the environment's counters).
    """
    from yatt.env.batch import step_all

    episodes = [[_start(row, make_env, tokenizer, limits) for _ in range(spec.n)] for row in rows]
    flat = [e for group in episodes for e in group]
    turn = 0
    while _turn_left(engine, active := [e for e in flat if e.end is None]):
        turn += 1
        seed = spec.seed if spec.seed is None or turn == 1 else spec.seed + turn * _TURN_SEED_STRIDE
        step = SamplingSpec(n=1, max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, seed=seed)
        caps = [_room(e, spec.max_tokens, limits) for e in active]
        outs = [c for (c,) in engine.generate([e.context() for e in active], step, max_tokens=[n for n, _ in caps])]
        texts = [_append_turn(e, c, tokenizer, cut) for e, c, (_, cut) in zip(active, outs, caps)]
        stepping = [(e, t) for e, t in zip(active, texts) if e.end is None]
        results = step_all([e.env for e, _ in stepping], [list(e.messages) for e, _ in stepping],
                           [t for _, t in stepping])
        for (e, text), result in zip(stepping, results):
            _reply(e, text, result, tokenizer, limits)
    return [[e.completion() for e in group] for group in episodes]


def _turn_left(engine, active: list) -> bool:
    """Another turn: this rank has active episodes, or (rollout TP) another rank of its engine has,
    and then this one takes the turn with none (the engine's ranks call it together)."""
    group = getattr(engine, "group", None)
    return group.any(bool(active)) if group is not None else bool(active)


def _start(row, make_env, tokenizer, limits: Limits) -> Episode:
    """A new episode of ``row``: its environment's first messages as the prompt (an environment that
    raises, or a prompt with no room left for a response, ends it before any turn)."""
    env = make_env()
    try:
        messages = list(env.reset(dict(row.entry)))
        ids = tokenizer.apply_chat_template(messages, tools=getattr(env, "chat_template_tools", None),
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as err:  # an environment that raises ends its episode, never the job
        log.warning("rollout.env: reset raised %s: %s; the episode scores rollout.env_error_score",
                    type(err).__name__, err)
        return Episode(env, [], list(row.prompt_ids), end="env_error")
    e = Episode(env, messages, list(ids))
    if len(e.prompt_ids) >= limits.max_model_len - 1:
        e.end = "context"
    return e


def _room(e: Episode, max_tokens: int, limits: Limits) -> tuple[int, str]:
    """The next model turn's token cap (>= 1: :func:`_reply` ends an episode left with no room)
    and the end reason of a turn cut there: ``rollout.max_tokens`` (``length``), or less where the
    episode's budget (``token_budget``) or the context length (``context``) leaves less."""
    budget, context = limits.max_tokens - len(e.token_ids), limits.max_model_len - 1 - len(e.context())
    cap = max(1, min(max_tokens, budget, context))
    return cap, "length" if cap == max_tokens else "token_budget" if budget <= context else "context"


def _append_turn(e: Episode, c: Completion, tokenizer, cut: str) -> str:
    """Append model turn ``c`` to ``e`` (a turn cut at its cap ends the episode, reason ``cut``);
    returns its text."""
    e.turns += 1
    e.token_ids += c.token_ids
    e.logprobs += c.logprobs
    e.mask += [1] * len(c.token_ids)
    e.final_ids = list(c.token_ids)
    e.stopped = c.finish_reason == "stop"
    if not e.stopped:
        e.end = cut
    return tokenizer.decode(c.token_ids, skip_special_tokens=True)


def _reply(e: Episode, text: str, result, tokenizer, limits: Limits) -> None:
    """The environment's reply to ``e``'s last turn ``text``: counted, then appended (its tokens
    masked out), or the episode ends (done, an error, or a limit)."""
    from yatt.env.template import observation_text

    e.env_reward += float(result.reward or 0.0)
    for k, v in (result.info or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            e.counters[k] = e.counters.get(k, 0.0) + float(v)
    if result.done:
        e.end = "env_error" if (result.info or {}).get("end_reason") == "env_error" else "done"
        if e.end == "env_error":
            log.warning("rollout.env: %s; the episode scores rollout.env_error_score", result.info.get("error"))
        return
    if e.turns >= limits.max_turns:
        e.end = "max_turns"
        return
    obs_text = observation_text(tokenizer, e.messages, text, result.observation,
                                tools=getattr(e.env, "chat_template_tools", None), generated_stop=tokenizer.eos_token)
    obs = tokenizer.encode(obs_text, add_special_tokens=False)
    if len(e.token_ids) + len(obs) >= limits.max_tokens:  # no room for a model token after it
        e.end = "token_budget"
    elif len(e.context()) + len(obs) >= limits.max_model_len - 1:
        e.end = "context"
    if e.end is not None:
        return
    e.messages += [{"role": "assistant", "content": text}, *result.observation]
    e.token_ids += obs
    e.logprobs += [0.0] * len(obs)
    e.mask += [0] * len(obs)


def episode_sums(completions) -> dict[str, tuple[float, float]]:
    """(sum, count) metrics of episodes (flat Completions with ``episode`` info): ``turns_mean``,
    ``turns_max``, ``turns_end_<reason>`` (episodes per end reason), ``turns_model_tokens_mean`` /
    ``turns_env_tokens_mean`` (tokens per model turn / per episode from the environment), and the
    environment's counters summed (``tool_calls_<tool>``, ``tool_errors_<tool>``, ...)."""
    eps = [c for c in completions if c.episode is not None]
    if not eps:
        return {}
    n = float(len(eps))
    turns = [c.episode["turns"] for c in eps]
    model = sum(sum(c.mask) for c in eps)
    sums = {"turns_mean": (float(sum(turns)), n), "turns_max": (float(max(turns)), 1.0),
            "turns_model_tokens_mean": (float(model), float(sum(turns))),
            "turns_env_tokens_mean": (float(sum(len(c.mask) - sum(c.mask) for c in eps)), n)}
    sums.update({f"turns_end_{r}": (float(sum(c.episode["end"] == r for c in eps)), 1.0) for r in END_REASONS})
    keys = {k for c in eps for k in c.episode if k not in ("turns", "end", "env_reward")}
    sums.update({k: (float(sum(c.episode.get(k, 0.0) for c in eps)), 1.0) for k in sorted(keys)})
    return sums


def answer_ids(completion) -> list[int]:
    """The tokens a reward reads: an episode's last model turn, else the whole response."""
    final = getattr(completion, "final_ids", None)
    return completion.token_ids if final is None else final


def make_generate(rollout, tokenizer, make_env=None):
    """The rollout call of every engine use (training batches and evaluation):
    ``(engine, rows, spec) -> out[i][k]`` Completions. Without ``make_env`` one response per
    sample (``engine.generate`` of the rows' prompts); with it :func:`run_episodes` under the
    ``rollout`` section's limits (``max_turns``, ``episode_max_tokens``, ``max_model_len``)."""
    if make_env is None:
        return lambda engine, rows, spec: engine.generate([r.prompt_ids for r in rows], spec)
    limits = Limits(rollout.max_turns, rollout.episode_max_tokens, rollout.max_model_len)
    return lambda engine, rows, spec: run_episodes(engine, make_env, rows, spec, tokenizer, limits)


def episode_rewards(completions, rewards: list[float], error_score: float) -> list[float]:
    """The rewards of flat ``completions`` (one per reward): an episode's scored reward plus the
    rewards its environment gave along the way, or ``error_score`` when its environment raised;
    a single response's reward as it is."""
    out = []
    for c, r in zip(completions, rewards):
        info = c.episode
        out.append(r if info is None else error_score if info["end"] == "env_error" else r + info["env_reward"])
    return out

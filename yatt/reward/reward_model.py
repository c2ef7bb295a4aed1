"""A discriminative reward model as a reward source (``reward.sources`` type ``reward_model``).

Any Hugging Face sequence-classification folder with one label (``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``, ...; the Bradley-Terry reward models of Ouyang et al. 2022,
"Training language models to follow instructions with human feedback", Sec. 3.5). The prompt
and the response are laid out as a chat (the prompt's conversation, or user: question; then
assistant: response) with the model's chat template, or as the turns' texts joined by blank lines
(``question\\n\\nresponse``) when it has none, and the score is the model's one logit at the last
token: an unbounded real number, not a probability.

It is served by its own vLLM engine with vLLM's pooling runner (fp32, unpadded batches of at most
``batch_size`` sequences, at most ``max_length`` tokens each, the prompt cut from the left if
needed). Building and shutting it down are collective like any engine's
(:mod:`yatt.rollout.vllm_engine`), so the placement holds it in the judge's slot
(:mod:`yatt.placement.runner`) and builds, releases and streams to it as it does the GenRM
judge, in every placement mode.
"""
from __future__ import annotations

from collections.abc import Sequence

from yatt.reward.genrm import JudgeItem, JudgeResult


def chat_ids(tokenizer, prompt: str | list[dict], response: str, max_length: int) -> list[int]:
    """The token ids a reward model scores (its last token's logit): the chat (``prompt``: a
    question, as one user turn, or a conversation of ``{role, content}`` messages; then assistant:
    ``response``) through the tokenizer's template, or the turns' texts and the response joined by
    blank lines without one; the last ``max_length`` ids. ``stage: rm`` trains on the same layout."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    turns.append({"role": "assistant", "content": response})
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False)
    else:
        ids = tokenizer("\n\n".join(t["content"] for t in turns))["input_ids"]
    return list(ids)[-max_length:]


class RewardModelScorer:
    """Scores responses with a one-label sequence-classification model on a vLLM pooling engine.

    Args:
        path: the model's HF folder. batch_size: most sequences per engine step. max_length: most
            tokens of one sequence (longer ones keep their last ``max_length`` tokens).
        kv_cache_memory_bytes: the engine's KV cache on CPU (it must hold ``max_length`` tokens).
        tp: ranks per engine (rollout TP, :mod:`yatt.rollout.tp_group`; collective over them).
    Raises:
        ValueError: the folder's model does not have exactly one label.
    """

    def __init__(self, path: str, batch_size: int = 16, max_length: int = 1024,
                 kv_cache_memory_bytes: int = 1 << 28, progress: str | None = None, tp: int = 1) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from yatt.rollout.vllm_engine import VLLMEngine

        labels = AutoConfig.from_pretrained(path).num_labels
        if labels != 1:
            raise ValueError(f"reward model {path}: {labels} labels; a reward model has one")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_length = max_length
        self.engine = VLLMEngine(path, tp=tp, runner="pooling", max_model_len=max_length, max_num_seqs=batch_size,
                                 kv_cache_memory_bytes=kv_cache_memory_bytes, progress=progress)
        self.seed = 0  # the placement sets it per step, as for a GenRM judge; scoring draws nothing

    def _ids(self, item: JudgeItem) -> list[int]:
        return chat_ids(self.tokenizer, item.messages or item.question, item.response, self.max_length)

    def score(self, items: Sequence[JudgeItem]) -> list[JudgeResult]:
        """One :class:`~yatt.reward.genrm.JudgeResult` per item; ``score`` is the reward logit."""
        logits = self.engine.classify([self._ids(it) for it in items]) if items else []
        return [JudgeResult(row[0], 0, 0, [row[0]]) for row in logits]

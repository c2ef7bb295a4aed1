"""A discriminative reward model as a reward source (``reward.sources`` type ``reward_model``).

Any Hugging Face sequence-classification folder with one label (``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``, ...; the Bradley-Terry reward models of Ouyang et al. 2022,
"Training language models to follow instructions with human feedback", Sec. 3.5). The prompt
and the response are laid out as a chat (user: question, assistant: response) with the model's
chat template, or as ``question\\n\\nresponse`` when it has none, and the score is the model's one
logit at the last token: an unbounded real number, not a probability.

It runs as a transformers forward pass on the rank (fp32, batches of ``batch_size`` sorted by
length and right-padded, at most ``max_length`` tokens, the prompt cut from the left if needed).
The placement holds it in the judge's slot (:mod:`yatt.placement.runner`): built, released and
streamed to as the GenRM judge is, in every placement mode; releasing it drops the weights.
"""
from __future__ import annotations

import gc
from collections.abc import Sequence

from yatt.reward.genrm import JudgeItem, JudgeResult


class RewardModelScorer:
    """Scores responses with a one-label sequence-classification model.

    Args:
        path: the model's HF folder. batch_size: sequences per forward pass. max_length: most
            tokens of one sequence (longer ones keep their last ``max_length`` tokens).
    Raises:
        ValueError: the folder's model does not have exactly one label, or its tokenizer has no
            pad token and no EOS token to pad with.
    """

    can_sleep = False  # released by dropping the weights (shutdown), rebuilt from the folder

    def __init__(self, path: str, batch_size: int = 16, max_length: int = 1024) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"reward model {path}: its tokenizer has neither a pad nor an EOS token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: {self.model.config.num_labels} labels; a reward model has one")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # where the last real token is
        self.model.eval()
        self.batch_size, self.max_length = batch_size, max_length
        self.engine, self.seed = self, 0  # the placement's judge slot reads .engine and sets .seed

    def _ids(self, item: JudgeItem) -> list[int]:
        tok = self.tokenizer
        if tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": item.question},
                                           {"role": "assistant", "content": item.response}],
                                          tokenize=True, return_dict=False)
        else:
            ids = tok(f"{item.question}\n\n{item.response}")["input_ids"]
        return list(ids)[-self.max_length:]

    def score(self, items: Sequence[JudgeItem]) -> list[JudgeResult]:
        """One :class:`~yatt.reward.genrm.JudgeResult` per item; ``score`` is the reward logit."""
        import torch

        seqs = [self._ids(it) for it in items]
        scores = [0.0] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        pad = self.tokenizer.pad_token_id
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                width = max(len(seqs[i]) for i in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, i in enumerate(batch):
                    ids[row, :len(seqs[i])], mask[row, :len(seqs[i])] = torch.tensor(seqs[i]), 1
                logits = self.model(input_ids=ids, attention_mask=mask).logits[:, 0]
                for row, i in enumerate(batch):
                    scores[i] = float(logits[row])
        return [JudgeResult(s, 0, 0, [s]) for s in scores]

    def shutdown(self) -> None:
        """Drop the weights (the slot's release on CPU) and hand the freed heap back to the OS."""
        from yatt.preload import release_free_heap

        self.model = None
        gc.collect()
        release_free_heap()

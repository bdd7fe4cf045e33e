"""Comparing greedy answers computed under different batch shapes, tie-aware.

Two runs of the same greedy turn need not pick the same token where the
model's top two logits are within fp32 noise: another batch composition sums
the same products in another order and moves logits by ~1e-6..1e-5, enough
to flip a near-tie, and everything after a flip differs. That is not wrong
K/V, and a test must not fail on it; but it must fail on anything else, so a
divergence is judged by recomputing the logits at the first differing
position over the recorded history with `transformers` on the same weights:

- both tokens within `TIE` of each other (and of the reference's own pick):
  a near-tie, and nothing after it is compared (the runs now continue
  different texts);
- any larger gap: one of the runs read or wrote wrong K/V, and the assertion
  says by how much, and which token the reference itself picks.

The tiny test models' median top-2 gap is ~0.3; below 1e-3 is rare (a few
steps in thousands), below 1e-4 rarer still.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TIE = 1e-3      # logit gap under which two tokens are a tie in fp32 (batch-shape noise is ~1e-5)


@dataclass(frozen=True, slots=True)
class Divergence:
    position: int          # index in the answers of the first differing token
    got: int
    expected: int
    gap: float             # |logit(got) - logit(expected)| under the reference model
    top: int               # the reference's own pick there
    top_gap: float         # logit(top) - max(logit(got), logit(expected)); 0 when top is one of them

    @property
    def near_tie(self) -> bool:
        return self.gap < TIE and self.top_gap < TIE

    def __str__(self) -> str:
        return (f"first differs at token {self.position}: got {self.got}, expected {self.expected}; "
                f"reference logit gap {self.gap:.3g} (a tie is < {TIE:g}), reference picks {self.top}"
                f"{f' by {self.top_gap:.3g}' if self.top_gap else ''}")


class Reference:
    """`transformers` on the checkpoint the workers serve: the judge of a divergence."""

    def __init__(self, model: Any, checkpoint: Path | str | None = None) -> None:
        self.model, self.checkpoint = model, checkpoint

    @classmethod
    def load(cls, checkpoint: Path | str) -> Reference:
        import transformers

        return cls(transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval(),
                   checkpoint)

    def encode(self, text: str) -> list[int]:
        """A text prompt's token ids, as inferd encodes it."""
        from inferd.checkpoint import load_tokenizer

        assert self.checkpoint is not None, "load the reference from its checkpoint to encode text"
        return list(load_tokenizer(Path(self.checkpoint)).encode(text).ids)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.tensor([tokens])).logits[0, -1].float()

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        tokens, out = list(tokens), []
        for _ in range(n):
            out.append(int(self.logits(tokens).argmax()))
            tokens.append(out[-1])
        return out

    def divergence(self, context: list[int], got: list[int], expected: list[int]) -> Divergence | None:
        """Where `got` first departs from `expected`, both answers to `context`; None when they agree."""
        position = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
        if position is None:
            assert len(got) == len(expected), f"answers of {len(got)} and {len(expected)} tokens"
            return None
        logits = self.logits(context + expected[:position])
        a, b = got[position], expected[position]
        top = int(logits.argmax())
        best = max(float(logits[a]), float(logits[b]))
        return Divergence(position, a, b, abs(float(logits[a] - logits[b])), top,
                          0.0 if top in (a, b) else float(logits[top]) - best)

    def assert_same(self, context: list[int], got: list[int], expected: list[int], what: str = "") -> bool:
        """Fail unless the answers agree up to a near-tie; False when they parted at one (compare no further)."""
        divergence = self.divergence(context, got, expected)
        if divergence is None:
            return True
        assert divergence.near_tie, f"{what}: {divergence}\n  got      {got}\n  expected {expected}"
        return False

    def assert_greedy(self, prompt: list[int], got: list[int], n: int, what: str = "greedy") -> bool:
        """`got` is the reference's own greedy answer of `n` tokens to `prompt`, up to a near-tie."""
        return self.assert_same(prompt, got, self.greedy(prompt, n), what)

    def assert_same_chats(self, turns: dict[Any, list[tuple[list[int], list[int], list[int]]]]) -> int:
        """Chats turn by turn: {chat: [(new prompt ids, got, expected), ...]}, each turn's history the
        prompts and expected answers before it. A chat is compared up to its first near-tie; returns the
        number of chats cut short by one."""
        ties = 0
        for chat, chat_turns in turns.items():
            history: list[int] = []
            for number, (prompt, got, expected) in enumerate(chat_turns):
                history += prompt
                if not self.assert_same(history, got, expected, f"chat {chat!r}, turn {number}"):
                    ties += 1
                    break
                history += expected
        return ties

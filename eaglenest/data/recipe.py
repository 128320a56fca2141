"""The training-data recipe: which text the drafter learns from, in one place.

A drafter learns the target's own distribution only from text the target wrote: trained on ShareGPT's
own answers, SmolLM2-135M's drafter reached a held-out accept length @3 of 1.56; on the target's own
greedy answers, 2.74. So the default recipe, ``regenerate``, lets the target answer every user turn of
every conversation in context (multi-turn: turn i sees its own answers to turns < i), greedily, with a
token cap per conversation. ``capture`` keeps the source's given answers (an explicit choice).

A greedy answer cut at the new-token limit is still the target's own text, token for token, and it is what
the target does when it serves (a small target loops until the limit: 5,866 of 10,000 ShareGPT first answers
of SmolLM2-135M at 512 tokens, measured on the H200). Skipping those samples left 41% of the data and a
drafter that accepted 1.53 tokens per cycle live on MT-Bench (0.95M training tokens), where the same prompts
with every answer kept had reached 1.92. So cut answers are kept by default (``cut_answers="keep"``: loss on
the tokens the target wrote, no end of turn, nothing after them); ``"skip"`` leaves such a sample out.

:data:`RECIPES` is the one home of these defaults: :class:`~eaglenest.extraction.config.ExtractParams`
fills every field the caller did not set from its ``recipe``, so the CLI, the flows, the pipeline and
the deployments all train on the same data unless told otherwise.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RecipeName = Literal["regenerate", "capture"]
DEFAULT_RECIPE: RecipeName = "regenerate"


class DataRecipe(BaseModel):
    """What a named recipe sets in an extraction (each field only where the caller did not set it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: RecipeName
    regenerate: bool = Field(description="The target answers every user turn itself (in context).")
    temperature: float = Field(0.0, description="0 = greedy; > 0 samples with a per-sample, per-turn seed.")
    max_new_tokens: int = Field(512, description="Most tokens per answer.")
    cut_answers: Literal["keep", "skip"] = Field("keep", description=(
        "An answer cut at max_new_tokens or at the token cap: keep = train on the tokens the target wrote (the "
        "sample ends there; no end of turn is trained on); skip = leave the sample out (the turns before it stay)."))
    max_turns: int | None = Field(None, description="Assistant turns kept per conversation (None = all).")
    max_tokens: int | None = Field(2048, description="Token cap per conversation (longer ones are skipped).")

    def extract_fields(self) -> dict[str, Any]:
        """The ExtractParams fields this recipe stands for."""
        return {"regeneration": {"enabled": self.regenerate, "temperature": self.temperature,
                                 "max_new_tokens": self.max_new_tokens, "cut_answers": self.cut_answers},
                "max_turns": self.max_turns, "max_tokens": self.max_tokens}


RECIPES: dict[str, DataRecipe] = {
    "regenerate": DataRecipe(name="regenerate", regenerate=True),
    "capture": DataRecipe(name="capture", regenerate=False),
}


def apply_recipe(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (ExtractParams input) with every recipe field it does not set filled from its recipe; a
    partial ``regeneration`` object is completed from the recipe's."""
    name = data.get("recipe", DEFAULT_RECIPE)
    if name not in RECIPES:
        return data  # the field's own validation names the choices
    out = dict(data)
    for key, value in RECIPES[name].extract_fields().items():
        given = out.get(key)
        if key not in out:
            out[key] = value
        elif key == "regeneration" and isinstance(given, dict):
            out[key] = {**value, **given}
    return out

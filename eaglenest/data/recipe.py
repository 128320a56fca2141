"""The training-data recipe: which text the drafter learns from, in one place.

A drafter learns the target's own distribution only from text the target wrote: trained on ShareGPT's
own answers, SmolLM2-135M's drafter reached a held-out accept length @3 of 1.56; on the target's own
greedy answers, 2.74. So the default recipe, ``regenerate``, lets the target answer every user turn of
every conversation in context (multi-turn: turn i sees its own answers to turns < i), greedily, with a
token cap per conversation. ``capture`` keeps the source's given answers (an explicit choice).

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
    max_new_tokens: int = Field(512, description="Most tokens per answer; an answer cut there is never trained on.")
    max_turns: int | None = Field(None, description="Assistant turns kept per conversation (None = all).")
    max_tokens: int | None = Field(2048, description="Token cap per conversation (longer ones are skipped).")

    def extract_fields(self) -> dict[str, Any]:
        """The ExtractParams fields this recipe stands for."""
        return {"regeneration": {"enabled": self.regenerate, "temperature": self.temperature,
                                 "max_new_tokens": self.max_new_tokens},
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

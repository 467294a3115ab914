"""A run's tokenizer, the recipe's prefix in its tokens, and the tokens of every text the run reads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.running.cells import DatasetRef, named
from aimet_quadapter.running.recipes import Recipe

if TYPE_CHECKING:  # imported when a run starts: the model code pulls in AIMET
    from aimet_quadapter.models import PreparedLM


@dataclass
class Shared:
    """One model, one tokenizer and one tokenization of each text for every seed of a recipe."""

    model: PreparedLM | None = None
    tokenizer: Any = None
    tokens: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)


@dataclass(eq=False)
class Texts:
    """The tokenizer of ``model_name``, loaded when first asked for, and the texts in its tokens."""

    recipe: Recipe
    model_name: str
    shared: Shared

    def tokenizer(self) -> Any:
        if self.shared.tokenizer is None:
            from aimet_quadapter.models import load_tokenizer

            self.shared.tokenizer = load_tokenizer(self.model_name)
        return self.shared.tokenizer

    def prefix_text(self) -> str | None:
        """The recipe's ``prefix`` (``auto``: the model's own, from its tokenizer; None: no prefix)."""
        from aimet_quadapter.models.prefix import AUTO_PREFIX, model_prefix

        return self.recipe.prefix if self.recipe.prefix != AUTO_PREFIX else model_prefix(self.tokenizer())

    def prefix_ids(self) -> list[int]:
        if (text := self.prefix_text()) is None:
            return []
        if not (ids := self.tokenizer()(text, add_special_tokens=False)["input_ids"]):
            raise QuadapterError(f"{self.recipe.where()}: field prefix: {text!r} gives no token")
        return list(ids)

    def tokens(self, source: str, split: str) -> torch.Tensor:
        from aimet_quadapter.text import data

        cache = self.shared.tokens
        if (source, split) not in cache:
            text = data.load_text(source, split)  # a file that is not text is refused before the tokenizer loads
            cache[source, split] = data.tokenize(self.tokenizer(), text)
        return cache[source, split]

    @contextlib.contextmanager
    def about(self, ref: DatasetRef) -> Iterator[None]:
        """A problem with the train split of ``ref`` (unreadable, too short) names the recipe and the dataset."""
        try:
            yield
        except QuadapterError as exc:
            raise QuadapterError(f"{self.recipe.where()}: train split of {named(ref)}: {exc}") from None

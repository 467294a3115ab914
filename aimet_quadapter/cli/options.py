"""Options more than one CLI command reads the same way."""

from __future__ import annotations

from typing import Any

from aimet_quadapter import logs
from aimet_quadapter.errors import QuadapterError

NO_PREFIX = "none"  # --prefix none: no prefix, where the default would be the model's own


def prefix_ids(tokenizer: Any, prefix: str | None) -> list[int] | None:
    """The tokens of ``--prefix`` (None without one); a prefix of no token is refused by name."""
    from aimet_quadapter.models.prefix import AUTO_PREFIX, model_prefix

    if prefix == AUTO_PREFIX:
        prefix = model_prefix(tokenizer)
        if prefix is None:
            logs.log.info("--prefix auto: the tokenizer has neither a BOS nor an EOS token: no prefix")
    if prefix is None or prefix == NO_PREFIX:
        return None
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    if not ids:
        raise QuadapterError(f"--prefix {prefix!r} gives no token")
    return list(ids)

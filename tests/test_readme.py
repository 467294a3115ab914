"""The README's Python example runs as written: only the model and the text are swapped for tiny local ones."""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import pytest

from tests.conftest import hf_tiny, make_corpus

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 1, "the README holds one Python example"
    return blocks[0]


def test_the_readme_example_is_short():
    assert len(_python_example().strip().splitlines()) <= 15


@pytest.fixture
def tiny_world(tmp_path, tiny_tokenizer):
    """A tiny GPT-2 that takes the example's 1,024-token windows, and a corpus long enough for its crops."""
    model_dir = tmp_path / "tiny-gpt2"
    model = hf_tiny("gpt2", positions=1024)
    model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    (text_dir / "train.txt").write_text(make_corpus(4000, seed=0), encoding="utf-8")
    (text_dir / "test.txt").write_text(make_corpus(3000, seed=2), encoding="utf-8")
    return model_dir, text_dir


def test_the_readme_example_runs(tiny_world, tmp_path, monkeypatch):
    model_dir, text_dir = tiny_world
    code = _python_example()
    for name, local in (('"smollm2-135m"', model_dir), ('"ptb"', text_dir)):
        assert name in code, f"the example no longer names {name}: update this test with it"
        code = code.replace(name, repr(str(local)))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    fp, quadapter = (float(x) for x in re.findall(r"(\d+\.\d+)", out.getvalue().splitlines()[-1]))
    assert math.isfinite(fp) and math.isfinite(quadapter) and fp > 1 and quadapter > 1
    from aimet_quadapter.quadapter import QuadapterState

    state = QuadapterState.load(tmp_path / "quadapter.safetensors")
    assert state.alphas, "the saved state holds the trained alphas"

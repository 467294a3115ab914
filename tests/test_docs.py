"""The command lines of the docs are ones the CLI takes, and the run folders they name are ones the runner writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from aimet_quadapter.cli.app import build_parser
from aimet_quadapter.running.recipes import load_recipe

ROOT = Path(__file__).resolve().parents[1]
# every page a user or contributor reads: the front page, the manual, and the READMEs of the other rooms
PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    # not the tools' own folders (.venv, .pytest_cache, build)
    *sorted(p for p in ROOT.glob("*/README.md") if p.parent.name != "build" and not p.parent.name.startswith(".")),
]


def _commands(page: Path) -> list[str]:
    """Every ``aimet-quadapter`` line of the page's bash blocks, continuation lines joined, comments and
    environment settings before the command dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # an environment setting before the command
                words = words[1:]
            if words[:1] == ["aimet-quadapter"]:
                out.append(shlex.join(words))
            # a pipeline of two commands (`run ... && report ...`)
            for i, word in enumerate(words):
                if word == "&&" and words[i + 1 : i + 2] == ["aimet-quadapter"]:
                    out.append(shlex.join(words[i:][1:]))
    return out


COMMANDS = [(page, line) for page in PAGES for line in _commands(page)]


def test_the_docs_hold_commands():
    assert {page.name for page, _ in COMMANDS} >= {"README.md", "export.md", "usage.md"}


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_each_command_is_one_the_cli_takes(page, line):
    words = shlex.split(line, comments=True)
    words = words[: words.index("&&")] if "&&" in words else words
    try:
        args = build_parser().parse_args(words[1:])
    except SystemExit:
        pytest.fail(f"{page.name}: the CLI refuses `{line}`")
    state = getattr(args, "state", None)
    if args.command == "export" and state and state.startswith("runs/"):
        _check_run_path(Path(state))


def _words(line: str) -> list[str]:
    """The first command of a line (`run ... && report ...` -> `run ...`)."""
    words = shlex.split(line, comments=True)
    return words[: words.index("&&")] if "&&" in words else words


RUNS = [(page, line) for page, line in COMMANDS if _words(line)[1:2] == ["run"]]


def test_the_results_page_runs_recipes():
    assert {page.name for page, _ in RUNS} >= {"README.md", "results.md"}


@pytest.mark.parametrize(("page", "line"), RUNS, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(RUNS)])
def test_each_run_names_a_recipe_that_loads_with_its_overrides(page, line):
    """`aimet-quadapter run RECIPE --set ...` in a page: the recipe file exists and loads as the CLI's `run` loads it,
    its `--set` overrides (and `--device`) applied and validated, so a table's command runs as written."""
    from aimet_quadapter.errors import QuadapterError

    args = build_parser().parse_args(_words(line)[1:])
    recipe = ROOT / args.recipe
    assert recipe.is_file(), f"{page.name}: `{line}` names {args.recipe}, which does not exist"
    overrides = [*args.overrides, *([f"device={args.device}"] if args.device else [])]  # as cli.app._cmd_run
    try:
        load_recipe(recipe, overrides)
    except QuadapterError as exc:
        pytest.fail(f"{page.name}: `{line}`: {exc}")


def _check_run_path(path: Path) -> None:
    """``runs/<recipe>/<data>/<method>/<method>.safetensors``: what a recipe's run writes (``Cell.folder``)."""
    parts = path.parts
    assert len(parts) == 5 and parts[3] + ".safetensors" == parts[4], f"{path}: not a state the runner writes"
    recipe = ROOT / "recipes" / f"{parts[1]}.yaml"
    assert recipe.is_file(), f"{path}: no recipe writes runs/{parts[1]}"
    loaded = load_recipe(recipe)
    assert Path(loaded.out) == Path(*parts[:2]), f"{path}: recipe {recipe.name} writes to {loaded.out}"
    assert parts[3] in loaded.methods, f"{path}: recipe {recipe.name} runs no {parts[3]}"
    groups = {"+".join(group) for group in loaded.fid}
    assert parts[2] in groups, f"{path}: recipe {recipe.name} fine-tunes on {sorted(groups)}, not {parts[2]}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# a link to a page, with or without a section, and the words of the page it quotes: `[x.md](x.md#s), "words"`,
# or `docs/x.md, "words"` (a path from the page's folder or the repository's)
REFERENCE = re.compile(r"\[[^\]]*\]\(([\w./-]+\.md)(?:#([\w-]+))?\)(?:, \"([^\"]+)\")?|([\w./-]+\.md), \"([^\"]+)\"")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_each_reference_to_a_page_finds_what_it_names(page):
    """A link's page and section exist, and the words a reference quotes are on that page: a section renamed or
    moved leaves no reference to it behind."""
    for match in REFERENCE.finditer(page.read_text(encoding="utf-8")):
        target, anchor, words = match.group(1) or match.group(4), match.group(2), match.group(3) or match.group(5)
        path = next((p for p in (page.parent / target, ROOT / target) if p.is_file()), None)
        assert path is not None, f"{page.name}: {target} does not exist"
        text = path.read_text(encoding="utf-8")
        if anchor:
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
            assert anchor in headings, f"{page.name}: {target} has no section #{anchor}"
        if words:
            assert words in text, f'{page.name}: {target} does not say "{words}"'

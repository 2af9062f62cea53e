"""README and the manual stay true: their code runs, and their lists match the code.

- Every ``python`` code block of README.md and of docs/*.md runs as a script
  (in a fresh interpreter, as a user would save and run it), and so do the
  examples of every public docstring.
- README's two commands are the ones CI's main environment runs (.ci/env).
- docs/settings.md has one row for every setting memshare reads: the
  ``MEMSHARE_*`` (and joblib's and loky's) environment variables named in the
  sources, and the arguments of ``Parallel``, ``MemmappingPool`` and the
  backend that ``parallel_config`` passes on.
- docs/troubleshooting.md has a section for every error and warning of
  ``memshare.__all__``, and docs/api.rst names every public name.

Each check is a function that returns what is missing; a test runs it on the
page and also on the page with one entry taken out, so that a check that
could no longer fail fails here.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Set, Tuple

import pytest
from conftest import run_script

import memshare
from memshare.backend import MemshareBackend

# Version-independent (the manual and README: their prose, tables and examples, whose API paths the unit tests cover
# everywhere): run in CI's whole-suite environment (main) only.
pytestmark = pytest.mark.version_independent

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
PACKAGE = ROOT / "src" / "memshare"

# -- code blocks -------------------------------------------------------------------

_FENCE = re.compile(r"^```(?P<lang>[^\n`]*)\n(?P<code>.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def code_blocks(path: Path, language: str = "python") -> List[Tuple[int, str]]:
    """The ``language`` blocks of the Markdown page ``path``: (line number, code)."""
    text = path.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, match.start()) + 1, match.group("code"))
        for match in _FENCE.finditer(text)
        if match.group("lang").strip() == language
    ]


BLOCKS = [(path, line, code) for path in PAGES for line, code in code_blocks(path)]


def test_pages_have_examples():
    """The pages the brief asks examples of have them (README: Parallel, scikit-learn, MemmappingPool)."""
    readme = "\n".join(code for path, _, code in BLOCKS if path.name == "README.md")
    for needed in ("Parallel(", 'parallel_config(backend="memshare")', "MemmappingPool("):
        assert needed in readme, f"README has no example using {needed}"


@pytest.mark.parametrize(
    "path, line, code", BLOCKS, ids=[f"{path.relative_to(ROOT)}:{line}" for path, line, _ in BLOCKS]
)
def test_code_block_runs(path, line, code, tmp_path):
    """Each block is a whole script: saved to a file and run, as a reader would."""
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, f"{path.relative_to(ROOT)}:{line} failed:\n{result.stdout}\n{result.stderr}"


DOCTESTS = """
import doctest
import memshare

failures, seen = 0, set()
for name in memshare.__all__:
    obj = getattr(memshare, name)
    # __version__ has no docstring of its own, MemmapingPool is MemmappingPool, delayed is joblib's.
    if isinstance(obj, str) or id(obj) in seen or not obj.__module__.startswith("memshare"):
        continue
    seen.add(id(obj))
    for test in doctest.DocTestFinder().find(obj, name, globs={}):
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test)
        failures += runner.failures
print("examples failed:", failures)
raise SystemExit(1 if failures else 0)
"""


def test_docstring_examples_run():
    """The Examples sections of the public docstrings give what they show."""
    run_script(DOCTESTS, timeout=280)


# -- README's commands and CI's ------------------------------------------------------


def readme_commands() -> List[str]:
    """The commands of README's "Two commands" block, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Two commands", 1)[1]
    block = _FENCE.search(section)
    assert block is not None and block.group("lang").strip() == "bash"
    return [line for line in block.group("code").splitlines() if line.strip() and not line.startswith("#")]


def test_readme_commands_are_cis():
    """README's second command is what .ci/env runs for the main environment, so CI runs README's command."""
    bench, tests = readme_commands()
    assert bench == 'python -m pip install -e ".[bench]" && python -m memshare bench'
    assert tests == 'python -m pip install -e ".[test]" && python -m pytest -q tests'
    env = (ROOT / ".ci" / "env").read_text(encoding="utf-8")
    install = re.search(r'pip install -qq (?:--no-compile )?-e "(?P<extra>\.\[\w+\])"', env)
    assert install and f'-e "{install.group("extra")}"' in tests, ".ci/env installs another extra than README"
    command = next(line for line in env.replace("\\\n", " ").splitlines() if "-m pytest" in line)
    assert re.search(r"\s-q\s", command) and re.search(r"\stests(\s|$)", command), ".ci/env runs other tests"
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ".ci/env main python3 whole" in run, ".ci/run's main environment no longer runs the whole suite"
    for page in ("getting-started.md", "contributing.md"):
        text = (DOCS / page).read_text(encoding="utf-8")
        assert tests in text, f"docs/{page} gives another test command than README"


# -- the settings table --------------------------------------------------------------

_ENV_NAME = re.compile(r"^(MEMSHARE|JOBLIB|LOKY)_[A-Z0-9_]+$")
#: Arguments of the backend that joblib sets itself, not the user.
_JOBLIB_OWN = {"self", "nesting_level", "inner_max_num_threads", "backend_kwargs"}


def environment_variables() -> Set[str]:
    """Every ``MEMSHARE_*``, ``JOBLIB_*`` and ``LOKY_*`` name the sources spell out (the benchmarks aside)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if "benchmarks" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _ENV_NAME.match(node.value):
                names.add(node.value)
    return names


def _parameters(function) -> Set[str]:
    return {
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) and name != "self"
    }


def settings_memshare_reads() -> Set[str]:
    """The names a row of the settings table must have."""
    from memshare._config import Settings

    names = environment_variables()
    names |= _parameters(memshare.MemmappingPool.__init__)
    names |= _parameters(memshare.Parallel.__init__)
    names |= _parameters(MemshareBackend.__init__) - _JOBLIB_OWN
    names |= _parameters(Settings.from_user)  # what Parallel passes on to joblib and memshare reads
    return names


def table_rows(text: str) -> List[str]:
    """The first cell (a name in backquotes) of each row of the page's first table."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.startswith("|"):
            in_table = True
            cell = line.split("|")[1].strip()
            match = re.fullmatch(r"`([^`]+)`", cell)
            if match:
                rows.append(match.group(1))
        elif in_table:
            break
    return rows


def settings_problems(text: str) -> List[str]:
    rows = table_rows(text)
    wanted = settings_memshare_reads()
    problems = [f"no row for {name}" for name in sorted(wanted - set(rows))]
    problems += [f"a row for {name}, which memshare does not read" for name in sorted(set(rows) - wanted)]
    problems += [f"two rows for {name}" for name in sorted({n for n in rows if rows.count(n) > 1})]
    return problems


def test_settings_table_lists_every_setting():
    text = (DOCS / "settings.md").read_text(encoding="utf-8")
    assert settings_problems(text) == []
    # The variables are found in the sources, not listed here: the scan must find the known ones.
    assert {"MEMSHARE_TEMP_FOLDER", "MEMSHARE_PROMOTE", "MEMSHARE_MEMFD", "MEMSHARE_DEBUG"} <= environment_variables()


def test_settings_check_fails_on_a_missing_row():
    text = (DOCS / "settings.md").read_text(encoding="utf-8")
    for name in ("MEMSHARE_DEBUG", "promote", "idle_worker_timeout", "progress"):
        without = "\n".join(line for line in text.splitlines() if not line.startswith(f"| `{name}` |"))
        assert f"no row for {name}" in settings_problems(without)


# -- troubleshooting and the API reference --------------------------------------------


def public_errors() -> Set[str]:
    return {
        name
        for name in memshare.__all__
        if isinstance(getattr(memshare, name), type) and issubclass(getattr(memshare, name), BaseException)
    }


def troubleshooting_problems(text: str) -> List[str]:
    sections = set(re.findall(r"^### `(\w+)`\s*$", text, re.MULTILINE))
    return [f"no section for {name}" for name in sorted(public_errors() - sections)]


def test_troubleshooting_lists_every_error_and_warning():
    assert {"WorkerDiedError", "SharedMemoryFallbackWarning"} <= public_errors()
    assert troubleshooting_problems((DOCS / "troubleshooting.md").read_text(encoding="utf-8")) == []


def test_troubleshooting_check_fails_on_a_missing_section():
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    for name in sorted(public_errors()):
        assert f"no section for {name}" in troubleshooting_problems(text.replace(f"### `{name}`", "### gone"))


def test_api_reference_names_every_public_name():
    text = (DOCS / "api.rst").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: (\w+)", text, re.MULTILINE))
    assert sorted(set(memshare.__all__) - documented) == []


def test_public_docstrings_have_numpydoc_sections():
    """Each public name memshare defines has an example; its functions say their parameters and what they return."""
    missing = []
    for name in memshare.__all__:
        obj = getattr(memshare, name)
        if isinstance(obj, str) or not obj.__module__.startswith("memshare"):
            continue  # __version__; delayed is joblib's
        doc = inspect.getdoc(obj) or ""
        wanted = ["Examples"]
        if inspect.isfunction(obj):
            wanted.append("Returns")
            if _parameters(obj):
                wanted.append("Parameters")
        elif not issubclass(obj, BaseException) and obj is not memshare.Broadcast:  # made by broadcast()
            wanted.append("Parameters")
        missing += [f"{name}: {section}" for section in wanted if not re.search(rf"^{section}\n-+$", doc, re.M)]
    assert missing == []


# Prose a reader takes in at once: the limits the manual and README keep to.
LONGEST_SENTENCE_WORDS = 35
LONGEST_CELL_CHARACTERS = 120
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")
# A paragraph ends at a blank line; a list item starts a paragraph of its own.
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )")


def prose_problems(text: str) -> List[str]:
    """Sentences and table cells of ``text`` (Markdown) longer than the limits above."""
    text = _FENCE.sub("", text)
    problems = []
    for line in text.splitlines():
        if line.startswith("|"):
            problems += [
                f"a table cell of {len(cell.strip())} characters: {cell.strip()[:60]}..."
                for cell in line.strip("|").split("|")
                if len(cell.strip()) > LONGEST_CELL_CHARACTERS
            ]
    for paragraph in _PARAGRAPH_BREAK.split(text):
        if paragraph.lstrip().startswith("|"):
            continue
        for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
            if len(sentence.split()) > LONGEST_SENTENCE_WORDS:
                problems.append(f"a sentence of {len(sentence.split())} words: {sentence[:60]}...")
    return problems


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.name)
def test_pages_keep_to_short_sentences_and_cells(path):
    assert prose_problems(path.read_text()) == []


def test_prose_check_finds_a_long_sentence_a_long_cell_and_not_a_list():
    sentence = " ".join(["word"] * (LONGEST_SENTENCE_WORDS + 1)) + "."
    cell = "| " + "x" * (LONGEST_CELL_CHARACTERS + 1) + " | short |"
    items = "\n".join(f"- item {i} has a few words." for i in range(10))
    assert len(prose_problems(f"Intro.\n\n{sentence}\n\n{cell}\n\n{items}\n")) == 2
    assert prose_problems(f"{items}\n\nShort. Another short one.\n") == []

"""The repository speaks of itself (STYLE.md, principle 17): no work-item numbers, no diary
chapters and no files named after either in what git tracks under src/, tests/, scripts/,
docs/, nor in README.md, BENCHMARKS.md and CHANGELOG.md. History lives in git.

Flagged in a text file's lines: ``issue 12``, ``issue #16``, ``issues #3``, ``work item``;
``fourteenth session``, ``twenty-first session`` (any ordinal spelled out), ``session12``,
``session 12``. Flagged in a path: a component holding ``session`` or ``issue`` followed by a
number, ``s21``-style chapter tags (``gpu_issue16_s21_route.sh``), and under scripts/ the names
of one-off runs (``gpu_issue*``, ``ab_*``, ``diag_*``, ``tune_*``, ``profile_*``). A bare
"session" is not flagged: a training session (one process's share of a run, ``_SessionFlag``,
``session_start``) and pytest's session scope are what the word means in this code.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "tests", "scripts", "docs", "README.md", "BENCHMARKS.md", "CHANGELOG.md")

ORDINALS = ("(?:(?:twenty|thirty|forty)-)?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|"
            "tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
            "nineteenth|twentieth|thirtieth|fortieth)")
# "issues N" without "#" is left alone: a kernel "issues 19-28% more instructions"
LINE_WORDS = re.compile(
    rf"\bissue[ _-]?#?\d+|\bissues #\d+|\bwork items?\b|\b{ORDINALS}[- ]sessions?\b"
    rf"|\bsessions?[ _-]?\d+",
    re.IGNORECASE,
)
PATH_WORDS = re.compile(r"sessions?[ _-]?\d|issues?[ _-]?\d|(?:^|[/_.-])s\d\d(?:[/_.-]|$)", re.IGNORECASE)
OLD_SCRIPT = re.compile(r"^(?:gpu_issue|ab_|diag_|tune_|profile_)")

ALLOWED: tuple[tuple[str, str], ...] = (
    # (path, phrase): the phrase is removed from that file's lines before they are matched
    ("tests/train/test_trainer.py", "the first session trained"),  # a run's first training process
)
def tracked_files() -> list[str]:
    """What git tracks under :data:`TREES` (a copy of the tree without git skips the check)."""
    if not (ROOT / ".git").exists():
        pytest.skip("no git repository: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z", "--", *TREES], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def line_findings(path: str, text: str) -> list[str]:
    """``path:line: words`` for each line of ``text`` that names a work item or a diary chapter."""
    allowed = [phrase for where, phrase in ALLOWED if where == path]
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for phrase in allowed:
            line = line.replace(phrase, "")
        words = [m.group(0) for m in LINE_WORDS.finditer(line)]
        if words:
            found.append(f"{path}:{n}: {', '.join(words)}")
    return found


def path_findings(path: str) -> list[str]:
    """``path: why`` when the path's name is a work item's, a diary chapter's or a one-off run's."""
    found = []
    if PATH_WORDS.search(path):
        found.append(f"{path}: named after a work item or a diary chapter")
    if path.startswith("scripts/") and OLD_SCRIPT.match(Path(path).name):
        found.append(f"{path}: a one-off run's name (a script is named for what it does)")
    return found


def _text(path: str) -> str | None:
    try:
        return (ROOT / path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return None  # binary (archives, pictures), or deleted in the working tree


def findings(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        out += path_findings(path)
        text = _text(path)
        if text is not None:
            out += line_findings(path, text)
    return out


def test_the_project_speaks_of_itself():
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its examples are the words it looks for
    found = findings([p for p in tracked_files() if p != this])
    assert not found, "work items or diary chapters (say why in the code's own terms):\n" + "\n".join(
        found)


@pytest.mark.parametrize(
    "line",
    ["Status (issue 16): correct", "see issue #12", "(issues #3, #4)", "a work item",
     "the fourteenth session's", "twenty-first session", 'BENCHMARKS.md, "Thirty-first session"',
     "docs/bench/session33/", "session 12", "Issue 2's workload", "h100-issue16-fwd.json"],
)
def test_a_work_item_or_a_diary_chapter_is_found(line):
    assert line_findings("src/lapse/x.py", f"ok\n{line}\n") != []
    assert line_findings("src/lapse/x.py", f"ok\n{line}\n")[0].startswith("src/lapse/x.py:2: ")


@pytest.mark.parametrize(
    "line",
    ["_SessionFlag = Annotated[bool, ...]", '@pytest.fixture(scope="session")',
     "End this session after this step", "one training session", "the host's time to issue one call",
     "1 issues each tile's loads", "its loop issues 19-28% more instructions",
     "https://github.com/o/r/issues/12", "a persistent kernel's items"],
)
def test_the_words_of_the_code_pass(line):
    assert line_findings("src/lapse/x.py", line) == []


@pytest.mark.parametrize(
    "path", ["scripts/gpu_issue16_s21_route.sh", "scripts/ab_fox_kernels.py", "scripts/diag_op_host.py",
             "scripts/tune_fox_fwd.py", "docs/bench/session14/h200-fwd.json",
             "docs/study/x/cpu-session12/t.md", "docs/bench/h100-issue16-baselines.json",
             "docs/x/run_s13_a.md"],
)
def test_a_path_named_after_history_is_found(path):
    assert path_findings(path) != []


CLEAN_PATHS = ["scripts/bench_all.sh", "scripts/study_dcp.sh", "src/lapse/train/session.py",
               "docs/bench/h200/attention-d64-f3f0ba6/results.md",
               "docs/study/eviction/smollm2/text/h2o-b0.1.json"]


@pytest.mark.parametrize("path", CLEAN_PATHS)
def test_a_path_named_for_what_it_holds_passes(path):
    assert path_findings(path) == []


def test_a_planted_line_fails_the_check():
    """The whole check on files: a line planted in a copy of a clean file is reported with its
    file and line; the allow-list drops only its own phrase in its own file."""
    clean = "src/lapse/bench/sweep.py"
    text = (ROOT / clean).read_text()
    assert findings([clean]) == []
    planted = text + "# measured in the twenty-second session (issue 16)\n"
    n = len(planted.splitlines())
    assert line_findings(clean, planted) == [f"{clean}:{n}: twenty-second session, issue 16"]
    allowed_path, phrase = ALLOWED[0]
    assert line_findings(allowed_path, f"# pretend {phrase} for hours") == []
    assert line_findings(clean, f"# pretend {phrase} for hours") != []

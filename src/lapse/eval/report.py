"""``lapse report RUN [RUN ...]``: one Markdown page gathering runs and their evaluations.

For each run folder it takes the training summary (``summary.json``, ``loss.png``) and
every evaluation written under ``RUN/eval/<name>/`` (its ``summary.md`` and the images
that page links to), one made under an eviction policy headed as such. With several
runs it starts with a side-by-side table, so comparing models is one command. Image
links are rewritten relative to the report's folder, and headings of the gathered pages
are pushed down three levels, under the evaluation's own heading.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

from lapse.eval.config import ReportConfig
from lapse.files import write_text_atomic
from lapse.models.checkpoint import read_run

_IMAGE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)(\))")
_HEADING = re.compile(r"^(#{1,4}) ", re.M)


def _summary(run: Path) -> dict:
    """The run's ``summary.json``; for a run that ended before writing one (it failed before
    its first step), its architecture and ACP from ``config.json`` (a failed run showed ``-``,
    "ACP off")."""
    path = run / "summary.json"
    if path.exists():
        return json.loads(path.read_text())
    try:
        model = read_run(run).model
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {"arch": model.name, "acp": model.acp}


def _relink(markdown: str, source_dir: Path, report_dir: Path) -> str:
    """Image links of a page in ``source_dir``, made relative to ``report_dir``."""

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z]+://", target) or os.path.isabs(target):
            return m.group(0)
        return m.group(1) + os.path.relpath(source_dir / target, report_dir) + m.group(3)

    return _IMAGE.sub(fix, markdown)


def _policy(folder: Path) -> str | None:
    """The eviction policy an evaluation ran under (its name, or how an older lm-eval result
    wrote it), from its ``results.json``; ``None`` for the model's own results."""
    try:
        results = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(results, dict):
        return None
    for where in (results.get("lapse"), results.get("config"), results):  # lm-eval, the others
        if isinstance(where, dict) and where.get("policy"):
            return str(where["policy"])
    return None


def _demote(markdown: str, levels: int = 3) -> str:
    return _HEADING.sub(lambda m: "#" * min(len(m.group(1)) + levels, 6) + " ", markdown)


def _comparison_table(runs: list[Path]) -> list[str]:
    lines = [
        "| run | arch | params | ACP | tokens | train loss | val loss | pruned | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = _summary(run)
        records = []
        metrics = run / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        last = {
            k: next((r for r in reversed(records) if r.get("kind") == k), None)
            for k in ("train", "val", "acp")
        }

        def fmt(record, key, spec):
            return format(record[key], spec) if record else "-"

        lines.append(
            f"| {run.name} | {s.get('arch', '-')} | "
            f"{format(s['params'] / 1e6, '.2f') + 'M' if 'params' in s else '-'} | "
            f"{'on' if s.get('acp') else 'off'} | {s.get('tokens', 0):,} | "
            f"{fmt(last['train'], 'loss', '.3f')} | {fmt(last['val'], 'loss', '.3f')} | "
            f"{fmt(last['acp'], 'pruned', '.1%')} | "
            f"{s.get('tokens_per_s', 0):,.0f} |"
        )
    return lines


def build_report(cfg: ReportConfig) -> Path:
    """Write the report page; returns its path."""
    runs = [Path(r) for r in cfg.runs]
    if cfg.out is not None:
        out = Path(cfg.out)
    elif len(runs) == 1:
        out = runs[0] / "eval" / "report.md"
    else:
        out = Path("runs/report") / ("-vs-".join(r.name for r in runs) + ".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    report_dir = out.parent.resolve()
    title = cfg.title or "lapse report: " + ", ".join(r.name for r in runs)
    lines = [
        f"# {title}",
        "",
        f"Generated {datetime.now():%Y-%m-%d %H:%M} from " + ", ".join(f"`{r}`" for r in runs) + ".",
        "",
    ]
    lines += ["## Training", ""] + _comparison_table(runs) + [""]
    for run in runs:
        lines += [f"## {run.name}", ""]
        if (run / "loss.png").exists():
            lines += [
                f"![training loss of {run.name}]({os.path.relpath(run.resolve() / 'loss.png', report_dir)})",
                "",
            ]
        evals = sorted(p for p in (run / "eval").glob("*/summary.md")) if (run / "eval").is_dir() else []
        if not evals:
            lines += ["No evaluations yet (`lapse eval ... ` writes them under `eval/`).", ""]
        for page in evals:
            text = page.read_text()
            policy = _policy(page.parent)  # a policy's results are not the model's own
            under = "" if policy is None else f": under the eviction policy `{policy}`"
            lines += [
                f"### {page.parent.name}{under}",
                "",
                _demote(_relink(text, page.parent.resolve(), report_dir)),
                "",
            ]
    return write_text_atomic(out, "\n".join(lines).rstrip() + "\n")

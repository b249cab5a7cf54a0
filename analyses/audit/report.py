"""The audit's report: checks, step results, and the whole report as text, Markdown and JSON."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nopelens.models.io import write_text_atomic

STATUSES = ("pass", "fail", "not_applicable")
STEP_TITLES = {
    1: "Token ids, padding, special tokens and position ids",
    2: "Index origin and signed-offset convention",
    3: "Masks separate from finite score biases",
    4: "Absolute position additions",
    5: "Q/K rotations and relation lookups",
    6: "Content scores and position contributions",
    7: "Combined scores and softmax",
    8: "Position interventions",
    9: "Cached vs uncached decoding",
    10: "Training and evaluation lengths",
}


@dataclass
class Check:
    """One verified claim: its name, whether it held, the measured value and the tolerance."""

    name: str
    passed: bool
    detail: str
    value: float | None = None
    tolerance: float | None = None


@dataclass
class StepResult:
    """One audit step: status (pass / fail / not_applicable), its checks and its evidence."""

    number: int
    title: str
    status: str
    summary: str
    checks: list[Check] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    reason: str | None = None

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


@dataclass
class AuditReport:
    """The audit of one model: what it is, the probe batch, and the ten steps."""

    model: dict[str, Any]
    probe: dict[str, Any]
    steps: list[StepResult]

    def step(self, number: int) -> StepResult:
        """The result of step ``number`` (1..10).

        Raises:
            KeyError: if there is no such step.
        """
        for step in self.steps:
            if step.number == number:
                return step
        raise KeyError(f"no audit step {number}; steps are 1..10")

    @property
    def failed_steps(self) -> list[int]:
        return [s.number for s in self.steps if s.status == "fail"]

    @property
    def passed(self) -> bool:
        """True when no step failed (not-applicable steps do not count against a model)."""
        return not self.failed_steps

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole report."""
        return _finite(
            {
                "model": self.model,
                "probe": self.probe,
                "passed": self.passed,
                "failed_steps": self.failed_steps,
                "steps": [asdict(s) for s in self.steps],
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False, allow_nan=False)

    def summary(self) -> str:
        """A one-screen terminal summary: one line per step, then warnings and the verdict."""
        mark = {"pass": "PASS", "fail": "FAIL", "not_applicable": "n/a "}
        lines = [f"nopelens audit: {self.model['name']} ({self.model['description']})"]
        if "measured_layer_positions" in self.model:
            if "measured_input_positions" in self.model:
                lines.append(f" measured input positions: {self.model['measured_input_positions']}")
            how = self.model.get("detector", "input held fixed, positions re-spaced")
            lines.append(f" measured per layer ({how}): {', '.join(self.model['measured_layer_positions'])}")
        if "learned_sinks" in self.model:
            lines += textwrap.wrap(
                self.model["learned_sinks"]["summary"], 110, initial_indent=" ", subsequent_indent="   "
            )
        if "padded_row_left_out" in self.probe:
            lines += textwrap.wrap(self.probe["padded_row_left_out"], 110, initial_indent=" ", subsequent_indent="   ")
        for s in self.steps:
            flag = " !" if s.warnings else ""
            lines.append(f" [{mark[s.status]}]{flag} {s.number:>2}. {s.title}: {_clip(s.summary, 90)}")
            for c in s.failed_checks[:3]:
                lines.append(f"          x {c.name}: {_clip(c.detail, 86)}")
        warnings = [(s.number, w) for s in self.steps for w in s.warnings]
        for number, warning in warnings:
            lines += textwrap.wrap(
                f"warning (step {number}): {warning}", 110, initial_indent=" ", subsequent_indent="   "
            )
        verdict = "no step failed" if self.passed else f"FAILED steps: {self.failed_steps}"
        counts = {k: sum(s.status == k for s in self.steps) for k in STATUSES}
        lines.append(
            f" {verdict} ({counts['pass']} pass, {counts['fail']} fail, {counts['not_applicable']} not applicable)"
        )
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The report as Markdown: model, probe batch, and per step its checks and evidence."""
        out = [f"# Position audit: {self.model['name']}", ""]
        out.append(f"Seed `002_c993a97fc3f160f5.txt`'s ten-step audit order. {self.model['description']}.")
        out.append("")
        out.append(f"**Verdict:** {'no step failed' if self.passed else f'steps {self.failed_steps} failed'}.")
        out += ["", "| step | title | status | summary |", "|---|---|---|---|"]
        for s in self.steps:
            out.append(f"| {s.number} | {s.title} | {s.status} | {_md(s.summary)} |")
        out += ["", "## Model", "", "```json", json.dumps(self.model, indent=1), "```", ""]
        out += ["## Probe batch", "", "```json", json.dumps(self.probe), "```", ""]
        for s in self.steps:
            out += [f"## Step {s.number}. {s.title}: {s.status}", "", s.summary, ""]
            if s.reason:
                out += [f"Not applicable: {s.reason}", ""]
            for w in s.warnings:
                out += [f"> **Warning:** {w}", ""]
            if s.checks:
                out += ["| check | result | value | tolerance | detail |", "|---|---|---|---|---|"]
                for c in s.checks:
                    value = "" if c.value is None else f"{c.value:.3g}"
                    tol = "" if c.tolerance is None else f"{c.tolerance:.3g}"
                    out.append(
                        f"| {_md(c.name)} | {'pass' if c.passed else '**fail**'} | {value} | {tol} | {_md(c.detail)} |"
                    )
                out.append("")
            if s.evidence:
                out += ["Evidence:", "", "```json", json.dumps(s.evidence), "```", ""]
        return "\n".join(out)

    def write(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write ``report.md`` and ``audit.json`` into ``out_dir``, each atomically.

        Returns:
            The two paths written.

        Raises:
            OSError: if the directory cannot be created or written.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        md, js = out_dir / "report.md", out_dir / "audit.json"
        write_text_atomic(md, self.to_markdown() + "\n")
        write_text_atomic(js, self.to_json() + "\n")
        return md, js


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write such measurements as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def by_reason(reasons: dict[int, str], noun: str = "layers") -> str:
    """``{layer: why}`` as one line, the layers (or blocks) grouped by reason ("" for none).

    Example:
        >>> by_reason({0: "a", 2: "a", 3: "b"}, noun="blocks")
        'blocks [0, 2]: a; blocks [3]: b'
    """
    grouped: dict[str, list[int]] = {}
    for layer, why in reasons.items():
        grouped.setdefault(why, []).append(layer)
    return "; ".join(f"{noun} {layers}: {why}" for why, layers in grouped.items())


def make_step(
    number: int,
    checks: list[Check],
    evidence: dict[str, Any],
    summary_pass: str,
    reason: str | None = None,
    warnings: list[str] | None = None,
) -> StepResult:
    """A step is not_applicable when it has a reason and no checks, fail if any check failed."""
    if not checks:
        if reason is None:
            raise ValueError(f"step {number} has neither checks nor a not-applicable reason")
        return StepResult(number, STEP_TITLES[number], "not_applicable", reason, [], evidence, warnings or [], reason)
    failed = [c for c in checks if not c.passed]
    if failed:
        summary = f"{len(failed)} of {len(checks)} checks failed: " + "; ".join(c.name for c in failed)
        return StepResult(number, STEP_TITLES[number], "fail", summary, checks, evidence, warnings or [])
    return StepResult(number, STEP_TITLES[number], "pass", summary_pass, checks, evidence, warnings or [])

"""The docs-check kinds for single figures: a line an example prints, a JSON report, a source document.

Each marker states its figures once, in its spec; the check first finds every stated figure in the
paragraph after the marker (so the marker and the visible text cannot drift apart), then:

* ``output``: the documented command (``python examples/<name>.py ...``) is run and the line it prints
  that matches the spec (a template with ``{number}`` holes) must carry each number within
  ``OUTPUT_TOLERANCE`` plus the rounding of the stated digits;
* ``report``: each ``stated=path[:unit]`` of the spec is read from the JSON report (a dotted path; list
  items by index) and, in ``unit`` (``GiB``, ``MB``; none: as stored), must round to the stated figure;
* ``quote``: each number of the spec must also stand in the source document the figure was taken from
  (a figure that cannot be re-measured within the tool's budget: a GPU run, hours of training).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Largest |printed - stated| of an example's figure, on top of the rounding of the stated digits.
OUTPUT_TOLERANCE = 0.02
#: Units a report figure may be stated in: bytes per unit.
UNITS = {"GiB": 2.0**30, "MB": 1e6}

_NUMBER = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_HOLE = re.compile(r"\{(" + _NUMBER + r")\}")
_NUMBER_TOKEN = re.compile(r"(?<![\w.])" + _NUMBER + r"(?![\w])")


def rounding(stated: str) -> float:
    """Half a unit of the last digit of ``stated`` (``"0.668"`` -> 0.0005, ``"3e-4"`` -> 0.5e-4)."""
    mantissa, _, exponent = stated.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def paragraph(body: str) -> str:
    """The text right after a marker, up to the first blank line."""
    return body.lstrip("\n").split("\n\n", 1)[0]


def missing_from_text(stated: list[str], body: str) -> list[str]:
    """The stated figures that the paragraph after the marker does not show."""
    shown = set(_NUMBER_TOKEN.findall(paragraph(body)))
    return [f"{value}: stated by the marker, not in the text that follows it" for value in stated if value not in shown]


def output_template(spec: str) -> tuple[re.Pattern[str], list[str]]:
    """A printed-line template with ``{number}`` holes: the regex of the line, and the stated numbers.

    Raises:
        ValueError: the template has no hole.
    """
    stated = _HOLE.findall(spec)
    if not stated:
        raise ValueError(f"an output spec needs {{number}} holes, got {spec!r}")
    pattern, last = "", 0
    for match in _HOLE.finditer(spec):
        pattern += re.escape(spec[last : match.start()]) + f"({_NUMBER})"
        last = match.end()
    return re.compile(pattern + re.escape(spec[last:])), stated


def compare_output(spec: str, stdout: str, tolerance: float = OUTPUT_TOLERANCE) -> list[str]:
    """Mismatches between a printed-line template's numbers and the last line of ``stdout`` it matches."""
    pattern, stated = output_template(spec)
    matches = [m for line in stdout.splitlines() if (m := pattern.search(line))]
    if not matches:
        return [f"no printed line matches {spec!r}"]
    problems = []
    for value, printed in zip(stated, matches[-1].groups(), strict=True):
        allowed = tolerance + rounding(value)
        if abs(float(printed) - float(value)) > allowed:
            problems.append(f"{spec!r}: stated {value}, printed {printed} (tol {allowed:g})")
    return problems


def report_spec(spec: str) -> list[tuple[str, str, float]]:
    """``stated=path[:unit] ...`` -> ``(stated, path, bytes per unit)`` per figure.

    Raises:
        ValueError: a figure is not ``number=path`` or names an unknown unit.
    """
    figures = []
    for word in spec.split():
        stated, sep, where = word.partition("=")
        path, _, unit = where.partition(":")
        if not sep or not re.fullmatch(_NUMBER, stated) or not path:
            raise ValueError(f"a report figure is `number=path[:unit]`, got {word!r}")
        if unit and unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r} in {word!r}; known: {', '.join(UNITS)}")
        figures.append((stated, path, UNITS.get(unit, 1.0)))
    if not figures:
        raise ValueError("a report marker states at least one `number=path` figure")
    return figures


def json_value(data: Any, path: str) -> Any:
    """The value at a dotted ``path`` of parsed JSON (list items by index)."""
    for key in path.split("."):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


def compare_report(spec: str, data: Any) -> list[str]:
    """Mismatches between the figures of a report spec and the report's values."""
    problems = []
    for stated, path, scale in report_spec(spec):
        try:
            value = float(json_value(data, path)) / scale
        except (KeyError, IndexError, ValueError, TypeError):
            problems.append(f"{path}: not a number in the report")
            continue
        if not math.isclose(value, float(stated), abs_tol=rounding(stated)):
            problems.append(f"{path}: stated {stated}, the report has {value:.6g}")
    return problems


def compare_quote(spec: str, source: str) -> list[str]:
    """The numbers of a quote spec that the source document does not contain."""
    shown = set(_NUMBER_TOKEN.findall(source))
    return [f"{value}: not in the source" for value in spec.split() if value not in shown]


def stated_figures(kind: str, spec: str) -> list[str]:
    """The figures a marker of ``kind`` states in its spec."""
    if kind == "output":
        return output_template(spec)[1]
    if kind == "report":
        return [stated for stated, _, _ in report_spec(spec)]
    return spec.split()


def example_argv(command: str) -> list[str]:
    """``python examples/<name>.py ...`` as this interpreter runs it.

    Raises:
        ValueError: the command is not one of the examples.
    """
    words = shlex.split(command)
    if len(words) < 2 or words[0] != "python" or not re.fullmatch(r"examples/\w+\.py", words[1]):
        raise ValueError(f"an output figure runs `python examples/<name>.py ...`, got {command!r}")
    return [sys.executable, str(ROOT / words[1]), *words[2:]]


def check_figure(kind: str, command: str, spec: str, body: str, run: Any) -> list[str]:
    """Mismatches of one ``output`` / ``report`` / ``quote`` figure.

    Args:
        kind: the marker's kind.
        command: what its backticks name: the example's command, the JSON report, the source document.
        spec: the marker's figures.
        body: the doc's text after the marker.
        run: ``run(argv) -> stdout``, how an example is run.
    """
    problems = missing_from_text(stated_figures(kind, spec), body)
    if kind == "output":
        return problems + compare_output(spec, run(example_argv(command)))
    source = ROOT / command
    if not source.is_file():
        return problems + [f"{command}: no such file"]
    if kind == "report":
        return problems + compare_report(spec, json.loads(source.read_text(encoding="utf-8")))
    return problems + compare_quote(spec, source.read_text(encoding="utf-8"))

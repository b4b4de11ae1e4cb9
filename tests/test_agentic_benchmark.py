"""benchmarks/agentic.py at its quick size (``make bench``): slow tools side by side and one at a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import agentic  # noqa: E402  (benchmarks/ is not a package)


def test_the_latency_is_long_tailed_and_fixed_by_the_arguments():
    latencies = [agentic.tool_latency(a, b) for a in range(100, 140) for b in range(200, 240)]
    assert latencies == [agentic.tool_latency(a, b) for a in range(100, 140) for b in range(200, 240)]
    assert min(latencies) >= 0.1 and max(latencies) == 2.0
    median = sorted(latencies)[len(latencies) // 2]
    assert 0.13 < median < 0.19 and 0.2 < sum(latencies) / len(latencies) < 0.32  # 0.16 and 0.26 in theory
    assert agentic.slow_multiply.__name__ == "multiply" and "Multiply two integers" in agentic.slow_multiply.__doc__


@pytest.mark.bench
def test_slow_tools_side_by_side_cost_less_than_one_at_a_time(tmp_path):
    output = tmp_path / "agentic.md"
    assert agentic.main(["--quick", "--output", str(output)]) == 0
    median = json.loads(output.with_suffix(".json").read_text())["results"]["median"]
    assert set(median) == set(agentic.VARIANTS)
    slow, serial = median["slow tool, side by side"], median["slow tool, one at a time"]
    # The same episodes (same prompts, seeds and tool results): the same reward and calls.
    assert slow["reward"] == serial["reward"] and slow["tool_calls_per_episode"] == serial["tool_calls_per_episode"]
    # One at a time the batch waits for every call in turn (64 episodes x their tool seconds); side by side
    # at least half of that is hidden behind the other calls.
    assert serial["rollout_s"] - slow["rollout_s"] > 0.5 * 64 * slow["tool_s_per_episode"]
    assert "| rollout with the slow tool within 1.3x" in output.read_text()

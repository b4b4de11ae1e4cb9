"""benchmarks/agentic.py and agentic_server.py (quick runs in ``make bench``): slow tools and environments."""

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


# ---------------------------------------------------------------------- benchmarks/agentic_server.py

import agentic_server  # noqa: E402


def test_the_servers_busy_time_is_the_union_of_the_calls_in_flight():
    assert agentic_server.busy_seconds([(0.0, 1.0), (0.5, 2.0), (1.5, 1.8), (3.0, 4.0)]) == 3.0
    assert agentic_server.busy_seconds([]) == 0.0
    latencies = [agentic_server.latency(f"word|{turn}|reply{i}") for i in range(400) for turn in range(3)]
    assert min(latencies) >= 0.1 and max(latencies) <= 2.0
    assert 0.2 < sum(latencies) / len(latencies) < 0.32  # the long-tailed latency of agentic.py, 0.26 in theory


def test_turn_length_statistics_by_hand():
    stats = agentic_server.turn_length_stats([10, 1, 9, 2, 8, 3, 7, 4, 6, 5])
    # Ten turns: mean 5.5, median between 5 and 6, the 90th percentile the 9th of the ten sorted, the longest 10.
    expected = {"turn_tokens_mean": 5.5, "turn_tokens_median": 5.5, "turn_tokens_p90": 9.0, "turn_tokens_max": 10.0}
    assert stats == expected


def test_the_environment_scores_each_reply_with_the_models_score_and_ends_at_the_third():
    calls = []

    def score(prompt, reply, metadata):
        calls.append((prompt, reply, metadata))
        return 0.6

    environment = agentic_server.Again(False, score)
    environment.reset("abc 40:", {})
    results = [environment.step(reply) for reply in ("a", "bb", "ccc")]
    assert [r.done for r in results] == [False, False, True] and [r.reward for r in results] == pytest.approx([0.2] * 3)
    assert calls == [("abc 40:", "a", {}), ("abc 40:", "bb", {}), ("abc 40:", "ccc", {})]
    assert results[0].messages == [{"role": "user", "content": "again"}]


def test_the_server_reports_summary_names_the_ratio_it_measured():
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("summarize", root / "tools" / "summarize.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    data = json.loads((root / "docs" / "reports" / "performance_agentic_server.json").read_text())
    median = data["results"]["median"]
    ratio = (
        median["slow environment, turn by turn"]["rollout_s"]
        / median["slow environment, each episode alone"]["rollout_s"]
    )
    lines = summarize.agentic_server(data)
    assert len(lines) == 2 + len(agentic_server.VARIANTS) + 2 and f"{ratio:.2f}x" in lines[-1]


@pytest.mark.bench
def test_episodes_alone_on_the_server_beat_turn_by_turn_with_a_slow_environment(tmp_path):
    output = tmp_path / "agentic_server.md"
    assert agentic_server.main(["--quick", "--output", str(output)]) == 0
    median = json.loads(output.with_suffix(".json").read_text())["results"]["median"]
    alone, by_turn = median["slow environment, each episode alone"], median["slow environment, turn by turn"]
    # Alone: the first turns in one call, then one call per episode and turn; turn by turn: one call a turn.
    assert alone["calls"] == 1 + 64 * (alone["turns_per_episode"] - 1) and by_turn["calls"] == 3
    assert alone["rollout_s"] < by_turn["rollout_s"] and alone["server_busy_share"] > by_turn["server_busy_share"]

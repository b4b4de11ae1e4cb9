"""benchmarks/vs_trl_tools.py: TRL's side of the reward by hand, the seeded rows, and a one-step run of both sides.

The run is a smoke test, not a timed one: TRL's ``GRPOTrainer(tools=[multiply])`` and the kit's episodes both ran on
the same checkpoint and prompts, and the JSON, the report and the performance page agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))
import vs_trl_tools  # noqa: E402  (benchmarks/ is not a package)

from lightning_offpolicy.data.tasks.tool_use import MultiplyToolTask  # noqa: E402


def _call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}


def test_trl_side_scores_the_last_assistant_reply_as_the_kit_scores_the_last_turn():
    answered = [
        {"role": "assistant", "content": "", "tool_calls": [_call(4821, 726)]},
        {"role": "tool", "name": "multiply", "content": "3500046"},
        {"role": "assistant", "content": "The answer is 3500046."},
    ]
    wrong = [*answered[:2], {"role": "assistant", "content": "The answer is 350046."}]
    stopped_at_a_call = answered[:1]  # the budget ended the episode before the tool's result was read
    after_the_tool = answered[:2]
    calls_again = [*answered[:2], {"role": "assistant", "content": "", "tool_calls": [_call(1, 2)]}]
    rewards = vs_trl_tools.trl_reward(
        prompts=[[]] * 5,
        completions=[answered, wrong, stopped_at_a_call, after_the_tool, calls_again],
        answer=[3500046] * 5,
        completion_ids=[[]] * 5,  # TRL passes more keywords; they are ignored
    )
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0]
    # The kit's reward on the same last turns (its text as the model wrote it).
    task = MultiplyToolTask()
    assert task.reward("The answer is 3500046.", {"answer": 3500046}) == 1.0
    assert task.reward('<tool_call>\n{"name": "multiply"}\n</tool_call>', {"answer": 3500046}) == 0.0


def test_rows_are_the_tasks_questions_in_a_seeded_order():
    rows = vs_trl_tools.make_rows(5, seed=3)
    assert rows == vs_trl_tools.make_rows(5, seed=3) and rows != vs_trl_tools.make_rows(5, seed=4)
    for row in rows:
        a, b = row["metadata"]["a"], row["metadata"]["b"]
        assert row["prompt"] == f"What is {a} * {b}?" and row["metadata"]["answer"] == a * b
        assert 1000 <= a <= 9999 and 100 <= b <= 999


@pytest.mark.long("TRL's GRPOTrainer(tools=...) and the kit's episodes, each a real fit in its own process")
@pytest.mark.bench("benchmarks/vs_trl_tools.py, at test size")
def test_vs_trl_tools_one_step(tmp_path):
    pytest.importorskip("trl")
    from lightning_offpolicy.demo.tool_use import prepare_tool_use_checkpoint

    # A short warm-up of the same recipe (tiny:multiply's own build is minutes; the soak builds that one).
    small = {"sft_steps": 20, "num_conversations": 64, "eval_prompts": 0}
    checkpoint = prepare_tool_use_checkpoint(directory=tmp_path / "model", **small)
    out = tmp_path / "performance_vs_trl_tools.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "vs_trl_tools.py"), "--steps", "1", "--seeds", "2", "--held-out-prompts", "4"]
        + ["--checkpoint", str(checkpoint), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.with_suffix(".json").read_text())
    header, runs, summary = data["header"], data["runs"], data["summary"]
    assert header["checkpoint"] == str(checkpoint) and header["num_prompts"] == 8 and header["seeds"] == [2]
    assert header["prompt_ids"] > 100  # the default system message and the tool's schema are in both prompts
    assert [(r["seed"], r["side"]) for r in runs] == [(2, "trl"), (2, "kit")]
    for run in runs:
        assert len(run["rewards"]) == len(run["step_s"]) == 1 and run["step_s"][0] > 0
        # 64 episodes, each 0 or 1: the step's success rate is a multiple of 1/64.
        assert 0.0 <= run["rewards"][0] <= 1.0 and (run["rewards"][0] * 64).is_integer()
        assert run["final_reward"] == run["rewards"][0]
        # The final model on 4 held-out questions, greedy and sampled: a multiple of 1/4 each.
        assert set(run["held_out"]) == {"greedy", "sampled"}
        assert all((4 * rate).is_integer() and 0 <= rate <= 1 for rate in run["held_out"].values())
    assert set(header["held_out_start"]) == {"greedy", "sampled"} and header["held_out_prompts"] == 4
    for side, run in zip(("trl", "kit"), runs, strict=True):
        assert data["held_out"][side]["greedy"] == {
            "mean": run["held_out"]["greedy"],
            "per_seed": [run["held_out"]["greedy"]],
        }
    assert [s["side"] for s in summary] == ["trl", "kit"]
    ratio = data["ratios"]["hf"]
    assert ratio["final_reward_kit_minus_trl"] == pytest.approx(runs[1]["rewards"][0] - runs[0]["rewards"][0])
    text = out.read_text()
    assert "| TRL GRPOTrainer | hf |" in text and "goal >=" not in text and out.with_suffix(".png").stat().st_size
    assert f"| `{checkpoint}` before training |" in text and "held-out success kit - TRL" in text
    page = subprocess.run(
        [sys.executable, str(BENCH_DIR.parent / "tools" / "summarize.py"), "--docs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert page.returncode == 0, page.stderr[-4000:]
    assert "[performance_vs_trl_tools.md](performance_vs_trl_tools.md)" in page.stdout
    assert f"| TRL GRPOTrainer | hf | **{runs[0]['final_reward']:.3f}** | never |" in page.stdout
    assert "Could not summarize" not in page.stdout


def test_an_interrupted_invocation_reports_the_sides_it_finished(tmp_path):
    """--from-workdir: the records a stopped run left (seed 0 both sides, seed 1 TRL only) are its report's runs."""

    def record(rewards, greedy):
        return {"rewards": rewards, "step_s": [1.0] * len(rewards), "wall_s": 9.0,
                "held_out": {"greedy": greedy, "sampled": 0.5}}  # fmt: skip

    for seed, sides in ((0, ("trl", "kit")), (1, ("trl",))):
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "rows.json").write_text("[]")
        for side in sides:
            (tmp_path / f"seed{seed}" / f"{side}.json").write_text(json.dumps(record([0.25, 0.75], 0.5 + seed / 4)))
    runs, elapsed = vs_trl_tools.runs_in_workdir(tmp_path)
    assert [(r["seed"], r["side"]) for r in runs] == [(0, "trl"), (0, "kit"), (1, "trl")] and elapsed >= 0
    assert runs[0]["final_reward"] == 0.5 and runs[0]["first_reward"] == 0.5
    held_out = vs_trl_tools.held_out_summary(runs)
    assert held_out["trl"]["greedy"] == {"mean": 0.625, "per_seed": [0.5, 0.75]}
    assert held_out["kit"]["greedy"] == {"mean": 0.5, "per_seed": [0.5]}
    with pytest.raises(FileNotFoundError, match="no finished side"):
        vs_trl_tools.runs_in_workdir(tmp_path / "seed1" / "missing")

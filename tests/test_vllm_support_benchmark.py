"""benchmarks/vllm_support.py at its quick size on real vLLM engines (``make bench``): the exact support."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.vllm_fixtures import requires_vllm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vllm_support  # noqa: E402  (benchmarks/ is not a package)


@pytest.mark.bench
@requires_vllm
def test_the_recorded_kept_sets_leave_no_support_unknown_on_either_engine(tmp_path, vllm_engine_holder):
    vllm_engine_holder.close()  # one engine at a time
    output = tmp_path / "report.md"
    assert vllm_support.main(["--quick", "--output", str(output)]) == 0
    import json

    payload = json.loads(output.with_suffix(".json").read_text())
    for engine in ("VLLMEngine", "RemoteVLLMEngine"):
        rows = {row["K"]: row for row in payload["rows"] if row["engine"] == engine}
        assert rows["recorded"]["unknown"] == 0.0  # the worker's record: every support known
        assert rows["recorded"]["max_width"] > 20  # nuclei the default top logprobs would not show
        assert rows[payload["vocab"]]["unknown"] == 0.0  # K = the vocabulary: every support is whole
        assert rows[20]["unknown"] > 0.5  # the quick build's barely trained model: most nuclei are wider than 20
        # Both ways read the same sets (the same seeds): their widths agree where both know them all.
        assert rows["recorded"]["mean_width"] == pytest.approx(rows[payload["vocab"]]["mean_width"])
    assert "| VLLMEngine | 0.9 | top 20 logprobs |" in output.read_text()

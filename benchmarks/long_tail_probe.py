"""The kit's training step on long-tailed batches: packed vs padded on the same rollouts, and its MFU.

Run by ``benchmarks/vs_trl_long_tail.py`` in its own process on the rollout batches the kit's side saved
(``rollouts/*.pt``). For each batch, alternately with ``packing="auto"`` (packed) and ``"off"``
(padded), it times one whole PPO update of ``OffPolicyRLModule`` as it ships (the same ``PPOUpdate``,
micro-batching, correction, forward and backward; the optimizer's ``step`` left out so that every
repeat sees the same weights), and counts the token positions each layout computes. The padding
share is the padded layout's share of positions that are padding; the speed-up it predicts is
``padded positions / real tokens``. Model FLOPs per step: ``6 x`` the parameters of the decoder
(embedding lookup excluded) per real token, ``6 x`` the output layer per response token (the only
positions whose logits the kit computes), and ``6 x n^2 x`` the attention width per layer and
sequence of ``n`` tokens (causal: half of the ``n x n`` scores, forward and backward). MFU divides
their rate by the best float32 matmul rate measured in the same process with the same threads; the
rate of the model's own matmul shapes alone (:func:`model_gemm_rate`) says how much of that peak a
step of this model could reach at all.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def matmul_peak(threads: int, repeats: int = 5) -> dict[str, float]:
    """Best float32 GFLOP/s of square matmuls (512, 1024, 2048) with ``threads`` threads."""
    torch.set_num_threads(threads)
    best: dict[str, float] = {}
    for size in (512, 1024, 2048):
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - began)
        best[str(size)] = 2 * size**3 / min(times) / 1e9
    return best


def model_gemm_rate(policy: torch.nn.Module, tokens: int, threads: int, repeats: int = 3) -> float:
    """GFLOP/s of the training step's matmuls alone, on the model's own shapes, for ``tokens`` tokens.

    Every ``nn.Linear`` of the decoder runs its forward ``x @ W.T`` and its two backward matmuls
    (``dY @ W``, ``dY.T @ x``) on ``tokens`` rows of random data (the best of ``repeats``); the rate
    is their FLOPs over their summed time: the ceiling a step made only of these matmuls would reach.
    """
    torch.set_num_threads(threads)
    head = policy.get_output_embeddings()
    shapes: dict[tuple[int, int], int] = {}
    for module in policy.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    flops = seconds = 0.0
    for (fan_in, fan_out), count in shapes.items():
        x, w, dy = torch.randn(tokens, fan_in), torch.randn(fan_out, fan_in), torch.randn(tokens, fan_out)
        for a, b in ((x, w.T), (dy, w), (dy.T, x)):  # the forward, then the two backward matmuls
            a @ b  # warm-up
            best = math.inf
            for _ in range(repeats):
                began = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - began)
            flops += 2.0 * tokens * fan_in * fan_out * count
            seconds += best * count
    return flops / seconds / 1e9


def model_flops(policy: torch.nn.Module, sequence_lengths: list[int], response_tokens: int) -> float:
    """Training FLOPs (forward + backward) of one pass over sequences of ``sequence_lengths`` real tokens."""
    config = policy.config
    embedding = policy.get_input_embeddings().weight.numel()
    head = policy.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in policy.parameters()) - embedding - head
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    attention = sum(6 * n * n * width * config.num_hidden_layers for n in sequence_lengths)
    return 6 * body * sum(sequence_lengths) + 6 * head * response_tokens + attention


def _positions(module: Any, rollout: Any, packed: bool) -> int:
    """Token positions the micro-batches of ``rollout`` compute in one layer (real tokens when packed)."""
    total = 0
    for rows in rollout.micro_batch_rows(module.max_tokens_per_microbatch, packed=packed):
        micro = rollout.select(rows).trim()
        total += int(micro.attention_mask.sum()) if packed else micro.attention_mask.numel()
    return total


def probe(model_dir: Path, rollout_files: list[Path], threads: int, repeats: int = 2) -> dict[str, Any]:
    """Time the kit's PPO update packed and padded on each saved rollout batch; count positions and FLOPs."""
    from harness.fit import bare_trainer

    from lightning_offpolicy.lightning.module import OffPolicyRLModule
    from lightning_offpolicy.lightning.update_hooks import ManualOptimizationHooks

    torch.set_num_threads(threads)
    modules = {}
    for mode in ("auto", "off"):
        module = OffPolicyRLModule(model=str(model_dir), packing=mode)
        module.configure_model()
        module.trainer = bare_trainer(1)
        modules[mode] = module
    modules["off"].policy.load_state_dict(modules["auto"].policy.state_dict())
    if not modules["auto"].packed or modules["off"].packed:
        raise RuntimeError("long_tail_probe: packing='auto' must pack and 'off' must pad for this model.")

    class Hooks(ManualOptimizationHooks):
        # The update as the module runs it, without Lightning's fit loop: a plain backward, and an
        # optimizer "step" that only clears the gradients (every repeat sees the same weights).
        world_size = 1

        def backward(self, loss: torch.Tensor) -> None:
            loss.backward()

        def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def optimizer_step(self) -> torch.Tensor:
            norm = self.clip_gradients()
            self.module.policy.zero_grad(set_to_none=True)
            return norm

    class Ignore:
        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    batches = []
    for path in rollout_files:
        rollout = torch.load(path, weights_only=False)
        seconds: dict[str, list[float]] = {"auto": [], "off": []}
        for _ in range(repeats + 1):  # the first round warms up
            for mode in ("auto", "off"):
                module = modules[mode]
                began = time.perf_counter()
                module.update(rollout, Hooks(module), Ignore(), logging=False, step_version=0)
                seconds[mode].append(time.perf_counter() - began)
        real = rollout.attention_mask.sum(-1).tolist()
        responses = int(rollout.response_mask.sum())
        flops = model_flops(modules["auto"].policy, [int(n) for n in real], responses)
        packed_s, padded_s = min(seconds["auto"][1:]), min(seconds["off"][1:])
        batches.append(
            {
                "rows": len(real),
                "real_tokens": int(sum(real)),
                "response_tokens": responses,
                "padded_positions": _positions(modules["off"], rollout, packed=False),
                "packed_positions": _positions(modules["auto"], rollout, packed=True),
                "packed_s": packed_s,
                "padded_s": padded_s,
                "model_gflop": flops / 1e9,
            }
        )
    peak = matmul_peak(threads)
    largest = max(batches, key=lambda b: b["real_tokens"])
    gemm = model_gemm_rate(modules["auto"].policy, largest["real_tokens"], threads)
    packed_total = sum(b["packed_s"] for b in batches)
    padded_total = sum(b["padded_s"] for b in batches)
    padded_positions = sum(b["padded_positions"] for b in batches)
    real_positions = sum(b["packed_positions"] for b in batches)
    gflop = sum(b["model_gflop"] for b in batches)
    best_peak = max(peak.values())
    return {
        "threads": threads,
        "batches": batches,
        "matmul_gflops": peak,
        "packed_s": packed_total,
        "padded_s": padded_total,
        "speedup": padded_total / packed_total,
        "padding_share": 1 - real_positions / padded_positions,
        "predicted_speedup": padded_positions / real_positions,
        "packed_gflops": gflop / packed_total,
        "padded_gflops": gflop / padded_total,
        "mfu": gflop / packed_total / best_peak,
        "mfu_padded": gflop / padded_total / best_peak,
        # The model's own matmul shapes alone: how much of the peak this model's matmuls can reach.
        "gemm_gflops": gemm,
        "gemm_share_of_peak": gemm / best_peak,
        "median_packed_s": statistics.median(b["packed_s"] for b in batches),
    }

"""GPU only: peak memory of ``HFEngine``'s lean sampling loop against ``generate``, plain and FSDP2-sharded.

A random-weight model shaped like Qwen2.5-1.5B in bf16 on one CUDA device (one NCCL rank for the
sharded case), 32 prompts x 8 samples, 32 new tokens. For each case: the peak allocated memory above
the weights, the time, and the first sampled ids (equal across samplers: they draw the same tokens).
``lean-no-grad`` is the lean loop under ``no_grad`` instead of ``inference_mode``, as it must run on a
sharded module (docs/reports/performance_gpu.md).

    python benchmarks/gpu_lean_memory_probe.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_offpolicy.rollout.engine import SamplingConfig  # noqa: E402
from lightning_offpolicy.rollout.hf.engine import HFEngine  # noqa: E402


def build(shard: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_lean_memory_probe.py needs a CUDA device.")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (20,), generator=rng).tolist() for _ in range(32)]
    sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, samples_per_prompt=8)
    for shard in (False, True):
        model = build(shard)
        for sampler in ("generate", "lean", "lean-no-grad"):
            engine = HFEngine(pad_token_id=0, eos_token_id=2, sampler="generate" if sampler == "generate" else "lean")
            engine._lean_inference_mode = sampler == "lean"
            engine.update_weights(model, 1)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            began = time.perf_counter()
            out = engine.generate(prompts, sampling, seed=3)
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**30
            print(
                f"sharded={shard} sampler={sampler:12s} peak extra {extra:.2f} GiB, weights {base / 2**30:.2f} GiB, "
                f"{time.perf_counter() - began:.2f} s, {sum(len(c.token_ids) for c in out)} tokens, "
                f"first ids {out[0].token_ids[:6]}",
                flush=True,
            )
        del model
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

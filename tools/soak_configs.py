"""The configs the soak runs: every shipped config that runs on this machine, in the form it runs in."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
BASE = "configs/quickstart.yaml"  # what the overlays (correction presets, tasks) are layered over

# The CPU forms of the GPU-only recipes that the suite runs (tests/test_journeys.py): the tiny model,
# float32, small sizes. Their max_steps stays the config's own (the soak runs it to the end).
CPU_FORMS: dict[str, list[str]] = {
    "lora_single_gpu.yaml": [
        "--model.model=tiny:reverse", "--model.torch_dtype=float32", "--model.lora_rank=8",
        "--model.lora_alpha=16", "--model.optimizer.init_args.lr=1e-3", "--trainer.accelerator=cpu",
        "--rollout.engine.init_args.start.dtype=float32", "--rollout.engine.init_args.start.max_model_len=128",
        "--rollout.engine.init_args.enforce_eager=true", "--rollout.sampling.max_new_tokens=8",
        "--rollout.sampling.samples_per_prompt=2", "--data.init_args.prompts_per_step=4",
    ],
}  # fmt: skip
# Local checkpoints that a shipped command builds (the config's own header names it): the soak builds
# a missing one first, so the config runs as a user runs it after that command.
BUILT_CHECKPOINTS: dict[str, list[str]] = {
    "checkpoints/tiny-qwen2-arith": ["examples/own_model_and_data.py", "--rl-steps", "0"],
}
NO_CPU_FORM: dict[str, str] = {
    "fsdp.yaml": "GPU-only (a 1.5B model sharded over every GPU of the node); the suite has no CPU form of this "
    "config (FSDP2 itself is tested on CPU in tests/test_module_fsdp.py)",
}


@dataclass
class SoakConfig:
    """One shipped config as the soak runs it."""

    name: str
    configs: list[str]
    args: list[str] = field(default_factory=list)
    uses_vllm: bool = False
    skip_reason: str | None = None


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def merged_config(configs: list[str]) -> dict[str, Any]:
    """The YAML files layered as the CLI layers them (later files win; enough to classify a config)."""
    out: dict[str, Any] = {}
    for path in configs:
        out = _merge(out, _load_yaml(ROOT / path))
    return out


def _uses_vllm(config: dict[str, Any]) -> bool:
    engine = (config.get("rollout") or {}).get("engine") or {}
    return "VLLM" in str(engine.get("class_path", "") if isinstance(engine, dict) else engine)


def _not_cpu_runnable(config: dict[str, Any]) -> str | None:
    trainer = config.get("trainer") or {}
    model = str((config.get("model") or {}).get("model", "tiny:"))
    if trainer.get("accelerator", "cpu") not in ("cpu",):
        return f"trainer.accelerator={trainer.get('accelerator')!r} (a GPU recipe) and the suite has no CPU form of it"
    if not model.startswith("tiny:") and model not in BUILT_CHECKPOINTS:
        return f"model {model!r} is not built locally (no model hub here) and the suite has no CPU form of it"
    return None


def shipped_configs() -> list[SoakConfig]:
    """Every config under configs/: top-level recipes, then the overlays layered over the quickstart."""
    out = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        rel = str(path.relative_to(ROOT))
        name = path.stem
        config = merged_config([rel])
        if path.name in CPU_FORMS:
            out.append(SoakConfig(f"{name} (CPU form)", [rel], list(CPU_FORMS[path.name]), _uses_vllm(config)))
        elif path.name in NO_CPU_FORM:
            out.append(SoakConfig(name, [rel], skip_reason=NO_CPU_FORM[path.name]))
        else:
            out.append(SoakConfig(name, [rel], uses_vllm=_uses_vllm(config), skip_reason=_not_cpu_runnable(config)))
    for folder in sorted(p for p in CONFIGS.iterdir() if p.is_dir()):
        for path in sorted(folder.glob("*.yaml")):
            rel = str(path.relative_to(ROOT))
            config = merged_config([BASE, rel])
            out.append(
                SoakConfig(
                    f"{folder.name}/{path.stem}",
                    [BASE, rel],
                    uses_vllm=_uses_vllm(config),
                    skip_reason=_not_cpu_runnable(config),
                )
            )
    return out


def select_configs(parser: argparse.ArgumentParser, only: list[str] | None) -> list[SoakConfig]:
    """The shipped configs ``--only`` names (all of them for ``None``); an unknown name is a usage error."""
    specs = shipped_configs()
    if only is None:
        return specs
    names = {s.name.split(" (")[0] for s in specs}
    missing = sorted(set(only) - names)
    if missing:
        parser.error(f"--only: unknown config(s) {missing}; known: {sorted(names)}")
    return [s for s in specs if s.name.split(" (")[0] in only]


def run_slug(name: str) -> str:
    """A config's name as a directory name (``correction/cispo`` -> ``correction__cispo``)."""
    return name.replace("/", "__").replace(" ", "_").replace("(", "").replace(")", "")


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None

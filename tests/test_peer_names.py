"""The peers' config names (verl, SkyRL, TRL) mapped to the kit's, or refused with the kit's equivalent.

``VERL_PRESETS`` is verl's rollout-correction preset list (``RolloutCorrectionConfig`` classmethods
in verl/trainer/config/algorithm.py at verl-project/verl 1dda039), field for field. Every one of
them is expressible in the kit: given with verl's names it either builds the kit config directly,
or (the signed k1 modes, whose ratio is the reciprocal of the kit's) is refused with a message
whose settings build it.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lightning_offpolicy.correction import CorrectionConfigError, PolicyLossConfig, compute_correction, policy_loss
from lightning_offpolicy.correction import OffPolicyCorrectionConfig as C
from lightning_offpolicy.correction.kl import kl_of_log_ratio
from lightning_offpolicy.correction.peer_names import PEER_DEFAULTS, PEER_OF, PeerNameWarning

ROOT = Path(__file__).resolve().parents[1]

GEO = dict(geo_mask=True, geo_mask_low=1 / 1.001, geo_mask_high=1 / 0.999)
K3 = dict(kl_reject="k3", kl_reject_level="seq_mean", kl_reject_threshold=0.01)

# name: (verl's fields, the kit's config)
VERL_PRESETS = {
    "disabled": (dict(rollout_is=None, rollout_rs=None), C()),
    "decoupled_token_is": (dict(rollout_is="token", rollout_is_threshold=2.0), C.token_tis()),
    "decoupled_seq_is": (dict(rollout_is="sequence", rollout_is_threshold=2.0), C.seq_tis()),
    "decoupled_token_icepop": (
        dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
        C(tis_level="token", tis_clip_high=5.0, token_mask=True, token_mask_low=0.5, token_mask_high=5.0),
    ),
    "decoupled_seq_is_rs": (
        dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
        C(tis_level="sequence", tis_clip_high=2.0, product_mask=True, product_mask_low=0.5, product_mask_high=2.0),
    ),
    "decoupled_geo_rs": (dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"), C(**GEO)),
    "bypass_ppo_clip": (dict(bypass_mode=True, loss_type="ppo_clip"), C.bypass()),
    "bypass_ppo_clip_geo_rs": (
        dict(bypass_mode=True, loss_type="ppo_clip", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
        C.bypass_ppo_clip_geo_rs(),
    ),
    "bypass_ppo_clip_k3_rs": (
        dict(bypass_mode=True, loss_type="ppo_clip", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
        C.bypass_ppo_clip_k3_rs(),
    ),
    "bypass_pg_is": (
        dict(bypass_mode=True, loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0),
        C.pure_is(level="sequence"),
    ),
    "bypass_pg_token_icepop": (
        dict(bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.5_5.0"),
        C.bypass_pg_token_icepop(),
    ),
    "bypass_pg_geo_rs": (
        dict(bypass_mode=True, loss_type="reinforce", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
        C.bypass_pg_geo_rs(),
    ),
    "decoupled_geo_rs_seq_tis": (
        dict(
            rollout_is="sequence",
            rollout_is_threshold=2.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="0.999_1.001",
        ),
        C(tis_level="sequence", tis_clip_high=2.0, **GEO),
    ),
    "decoupled_geo_rs_token_tis": (
        dict(
            rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"
        ),
        C(tis_level="token", tis_clip_high=2.0, **GEO),
    ),
    "bypass_pg_geo_rs_seq_tis": (
        dict(
            bypass_mode=True,
            loss_type="reinforce",
            rollout_is="sequence",
            rollout_is_threshold=2.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="0.999_1.001",
        ),
        C.bypass_pg_geo_rs_seq_tis(),
    ),  # fmt: skip
    "bypass_pg_geo_rs_token_tis": (
        dict(
            bypass_mode=True,
            loss_type="reinforce",
            rollout_is="token",
            rollout_is_threshold=2.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold="0.999_1.001",
        ),
        C.bypass_pg_geo_rs_token_tis(),
    ),  # fmt: skip
    "decoupled_k3_rs": (dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01), C.decoupled_k3_rs()),
    "decoupled_k3_rs_seq_tis": (
        dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
        C(tis_level="sequence", tis_clip_high=2.0, **K3),
    ),
    "decoupled_k3_rs_token_tis": (
        dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
        C(tis_level="token", tis_clip_high=2.0, **K3),
    ),
}


def _settings_of(message: str) -> dict:
    """The ``name: value`` settings a refusal proposes (after 'the same rejection is')."""
    text = message.split("the same rejection is", 1)[1].split("(", 1)[0]
    return {k: yaml.safe_load(v) for k, v in re.findall(r"(\w+): ([\w.]+)", text)}


def test_the_verl_preset_list_is_complete():
    assert len(VERL_PRESETS) == 19


@pytest.mark.parametrize("name", list(VERL_PRESETS))
def test_every_verl_preset_is_expressible(name):
    verl, expected = VERL_PRESETS[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            built = C.from_peer_names(**verl)
        except CorrectionConfigError as err:
            # The signed k1 modes: refused, with the kit's settings for the same rejection.
            assert "k1" in str(err) and "reciprocal" in str(err), err
            kept = {k: v for k, v in verl.items() if not k.startswith("rollout_rs")}
            built = C.from_peer_names(**kept, **_settings_of(str(err)))
    assert built == expected, (name, built.to_dict(), expected.to_dict())
    messages = [str(w.message) for w in caught if issubclass(w.category, PeerNameWarning)]
    assert all(message.startswith("verl's") and "the kit's" in message for message in messages), messages
    assert not any(hasattr(built, field) for field in PEER_OF), "peer names are no fields of the config"


@pytest.mark.parametrize(
    ("skyrl", "expected"),
    [
        (dict(tis_ratio_type="token", token_tis_ratio_clip_high=2.0), C.token_tis()),
        (dict(tis_ratio_type="sequence"), C.seq_tis(clip_high=5.0)),  # SkyRL's own default cap
        (dict(sequence_mask_metric="geometric", geo_mask_low=0.99, geo_mask_high=1.01), C.geo_mis()),
        (dict(sequence_mask_metric="product"), C.seq_mis()),
        (dict(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0), C.token_mis()),
        (
            dict(outlier_token_is_threshold_low=1e-4, outlier_token_is_threshold_high=100.0),
            C.outlier_veto(),
        ),
    ],
)
def test_skyrl_names(skyrl, expected):
    with pytest.warns(PeerNameWarning, match="SkyRL's .* the kit's"):
        assert C.from_peer_names(**skyrl) == expected


@pytest.mark.parametrize(
    ("trl", "expected"),
    [
        (
            dict(vllm_importance_sampling_correction=True),  # TRL's defaults: sequence_mask, C_max 3
            C(tis_level="sequence", tis_clip_high=3.0, product_mask=True, product_mask_low=None, product_mask_high=3.0),
        ),
        (
            dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0),
            C.token_tis(),
        ),
        (
            dict(
                vllm_importance_sampling_mode="token_mask",
                vllm_importance_sampling_clip_min=0.5,
                vllm_importance_sampling_clip_max=2.0,
            ),
            C.token_mis().replace(tis_level="token", tis_clip_high=2.0),
        ),  # fmt: skip
        (
            dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_cap=4.0),
            C.seq_tis(clip_high=4.0),
        ),
    ],
)
def test_trl_names(trl, expected):
    with pytest.warns(PeerNameWarning, match="TRL's .* the kit's"):
        assert C.from_peer_names(**trl) == expected
    with pytest.warns(PeerNameWarning, match="is the kit's default"):
        assert C.from_peer_names(vllm_importance_sampling_correction=False) == C()


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (dict(use_opsm=True), C.opsm(threshold=1e-4, reference="prox")),  # slime's --opsm-delta, old log-probs
        (dict(use_opsm=True, opsm_delta=0.01), C.opsm(threshold=0.01, reference="prox")),
        (dict(off_policy_mask_threshold=0.5), C.opsm()),  # TRL: against its vLLM logprobs
    ],
)
def test_opsm_names(names, expected):
    with pytest.warns(PeerNameWarning, match="(slime|TRL)'s .* the kit's opsm_mask: true"):
        assert C.from_peer_names(**names) == expected


def test_areal_m2_threshold():
    with pytest.warns(PeerNameWarning, match="AReaL's m2_threshold=0.04 is the kit's m2po_mask: true"):
        assert C.from_peer_names(m2_threshold=0.04) == C.m2po() == C.m2po(threshold=0.04)
    with pytest.warns(PeerNameWarning):
        assert C.from_peer_names(m2_threshold=0.1, tis_level="token") == C.m2po(threshold=0.1).replace(
            tis_level="token"
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rollout_is="token", vllm_importance_sampling_mode="token_mask"), "TRL and verl are mixed"),
        (dict(rollout_rs="token_k2,seq_mean_k3", rollout_rs_threshold=0.01), "one kl_reject"),
        (dict(rollout_rs="seq_mean_k9", rollout_rs_threshold=0.01), "unknown"),
        (dict(rollout_rs="seq_mean_k3"), "needs rollout_rs_threshold"),
        (
            dict(
                rollout_is="token", rollout_is_batch_normalize=True, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1
            ),
            "before rejection",
        ),
        (dict(loss_type="reinforce"), "only in bypass mode"),
        (dict(rollout_is="token", tis_level="sequence"), "conflicts"),
        (
            dict(
                outlier_token_is_threshold_high=100.0, token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0
            ),
            "before its token mask",
        ),
        (dict(tis_ratio_type="tokens"), "not one of"),
        (dict(m2_threshold=0.04, use_opsm=True), "AReaL and slime are mixed"),
        (dict(m2_threshold=-1.0), "m2_threshold"),
    ],
)
def test_differences_are_refused_with_how(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeerNameWarning)
        with pytest.raises(CorrectionConfigError, match=message):
            C.from_peer_names(**kwargs)


def test_peer_names_from_yaml_and_round_trip():
    text = """
rollout_is: token
rollout_is_threshold: 2.0
rollout_rs: seq_mean_k3
rollout_rs_threshold: 0.01
"""
    with pytest.warns(PeerNameWarning):
        cfg = C.from_peer_names(**yaml.safe_load(text))
    assert cfg == C(tis_level="token", tis_clip_high=2.0, **K3)
    assert not set(cfg.to_dict()) & set(PEER_OF), "peer names never reach a saved config"
    assert C(**cfg.to_dict()) == cfg


# ------------------------------------------------------------------- the peers' own computations
# Float64 plain loops written from the peers' code, not from the kit's: SkyRL a956457
# (skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py, ppo_utils.py), TRL f2cd577
# (trl/trainer/grpo_trainer.py `_generate_and_score_completions`, grpo_config.py `__post_init__`),
# verl 1dda039 (verl/trainer/ppo/core_algos.py `compute_policy_loss_vanilla`, `kl_penalty_forward`).
def _f32(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(x, dtype=np.float32))


def _skyrl_safe_exp(x: float) -> float:
    return math.exp(min(max(x, -20.0), 20.0))  # safe_exp_delta(..., clip=20.0)


def _skyrl_token_mask(old: np.ndarray, rollout: np.ndarray, loss_mask: np.ndarray, low, high) -> np.ndarray:
    """SkyRL's loss mask after ``compute_off_policy_correction`` with only the token-mask bounds set."""
    out = loss_mask.astype(np.float64).copy()
    # `apply_token_mask = low is not None and high is not None`: one bound alone applies nothing.
    if low is None or high is None:
        return out
    for i in range(out.shape[0]):
        for t in range(out.shape[1]):
            ratio = _skyrl_safe_exp(float(old[i, t]) - float(rollout[i, t]))
            if loss_mask[i, t] > 0 and not (low <= ratio <= high):
                out[i, t] = 0.0
    return out


# log(pi_old / pi_rollout) per token: -1.0 and -2.0 are below 0.5 in ratio, 1.5 and 0.9 above 2.0.
SKYRL_LOG_RHO = np.array([[-1.0, 0.1, 1.5, -0.05], [0.9, -2.0, 0.0, 0.3]])


@pytest.mark.parametrize(("low", "high"), [(None, 2.0), (0.5, None), (0.5, 2.0)])
def test_skyrl_token_mask_needs_both_bounds(low, high):
    rollout = np.full(SKYRL_LOG_RHO.shape, -1.5)
    old = rollout + SKYRL_LOG_RHO
    mask = np.ones_like(old)
    given = {"token_mask_is_threshold_low": low, "token_mask_is_threshold_high": high}
    with pytest.warns(PeerNameWarning, match="SkyRL's"):
        cfg = C.from_peer_names(**{name: value for name, value in given.items() if value is not None})
    out = compute_correction(_f32(old), _f32(rollout), _f32(mask), cfg)
    expected = _skyrl_token_mask(old, rollout, mask, low, high)
    np.testing.assert_array_equal(out.mask.double().numpy(), expected)
    if low is None or high is None:
        assert cfg == C() and expected.all()  # SkyRL masks none, the token with log ratio -1 included
    else:
        assert not expected.all()


def test_skyrl_one_token_bound_says_it_turns_nothing_on():
    with pytest.warns(PeerNameWarning, match="alone turns no mask on") as caught:
        C.from_peer_names(token_mask_is_threshold_high=2.0)
    assert "token_mask_low: null" in str(caught[0].message), "the kit's one-sided mask is spelled out"


def test_skyrl_outlier_veto_with_one_token_bound_is_the_veto_alone():
    with pytest.warns(PeerNameWarning):
        cfg = C.from_peer_names(
            outlier_token_is_threshold_low=1e-4, outlier_token_is_threshold_high=100.0, token_mask_is_threshold_high=2.0
        )
    assert cfg == C.outlier_veto()


def _trl_importance_weights(old, sampling, mask, mode, clip_min, clip_max) -> np.ndarray:
    """TRL's ``importance_sampling_ratio`` per token: clamped (``*_truncate``) or 0 outside the bounds (``*_mask``)."""
    diff = (old - sampling) * mask  # per_token_logps_diff
    out = np.zeros(old.shape)
    for i in range(old.shape[0]):
        seq = float(diff[i].sum())
        for t in range(old.shape[1]):
            ratio = math.exp(seq if mode.startswith("sequence") else float(diff[i, t]))  # torch.exp, no clamp
            if mode.endswith("truncate"):  # torch.clamp(ratio, min=clip_min, max=clip_max): None is open
                ratio = ratio if clip_min is None else max(ratio, clip_min)
                ratio = ratio if clip_max is None else min(ratio, clip_max)
            else:  # None -> -inf / +inf, then masked_fill(outside, 0.0)
                low = -math.inf if clip_min is None else clip_min
                high = math.inf if clip_max is None else clip_max
                ratio = 0.0 if (ratio < low or ratio > high) else ratio
            out[i, t] = ratio
    return out


TRL_LOG_RHO = np.array([[2.0, -0.9, 0.2, 0.05], [-0.3, 0.4, 1.2, -0.1]])  # a token with ratio e^2 = 7.39
NOT_GIVEN = "not given"


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max"),
    [
        ("token_truncate", 0.5, None),
        ("token_mask", 0.5, None),
        ("sequence_truncate", 0.5, None),
        ("sequence_mask", None, None),
        ("token_mask", 0.5, NOT_GIVEN),  # TRL's default C_max = 3.0
        ("token_truncate", None, 2.0),
    ],
)
def test_trl_importance_weights_follow_trl(mode, clip_min, clip_max):
    sampling = np.full(TRL_LOG_RHO.shape, -1.2)
    old = sampling + TRL_LOG_RHO
    mask = np.ones_like(old)
    kwargs = {"vllm_importance_sampling_mode": mode}
    if clip_min is not None:
        kwargs["vllm_importance_sampling_clip_min"] = clip_min
    if clip_max is not NOT_GIVEN:
        kwargs["vllm_importance_sampling_clip_max"] = clip_max
    with pytest.warns(PeerNameWarning, match="TRL's"):
        cfg = C.from_peer_names(**kwargs)
    out = compute_correction(_f32(old), _f32(sampling), _f32(mask), cfg)
    expected = _trl_importance_weights(old, sampling, mask, mode, clip_min, 3.0 if clip_max is NOT_GIVEN else clip_max)
    np.testing.assert_allclose((out.weights * out.mask).double().numpy(), expected, rtol=1e-6)


def test_trl_clip_max_none_is_no_upper_bound():
    with pytest.warns(PeerNameWarning, match="no upper bound"):
        cfg = C.from_peer_names(
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_min=0.5,
            vllm_importance_sampling_clip_max=None,
        )
    assert cfg.tis_level == "token" and cfg.tis_clip_high == math.inf and cfg.tis_clip_low == 0.5
    prox, rollout = torch.tensor([[-1.0]]), torch.tensor([[-3.0]])
    weight = compute_correction(prox, rollout, torch.ones(1, 1), cfg).weights
    assert float(weight) == pytest.approx(math.exp(2.0), rel=1e-6)  # 7.39 as in TRL, not the default cap 3.0
    with pytest.warns(PeerNameWarning):
        default_cap = C.from_peer_names(vllm_importance_sampling_mode="token_truncate")
    assert default_cap.tis_clip_high == 3.0


def test_trl_clip_max_none_survives_copies_and_reads_not_given_afterwards():
    with pytest.warns(PeerNameWarning):
        cfg = C.from_peer_names(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None)
    assert cfg.token_mask and cfg.token_mask_high is None and cfg.tis_clip_high == math.inf
    assert PEER_DEFAULTS["vllm_importance_sampling_clip_max"] == 3.0
    assert not hasattr(cfg, "vllm_importance_sampling_clip_max")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a copy maps nothing again
        assert cfg.replace() == cfg
        assert C(**cfg.to_dict()) == cfg
        assert C(**yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg  # inf is YAML's .inf
        assert C.from_peer_names(vllm_importance_sampling_clip_max=3.0) == C(), "TRL's default alone turns nothing on"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None), "both None"),
        (dict(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=2.0), "must be less than"),
        (dict(tis_level="token", tis_clip_high=float("nan")), "tis_clip_high"),
        (dict(tis_level="token", tis_clip_high=-math.inf), "tis_clip_high"),
    ],
)
def test_trl_refusals(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeerNameWarning)
        with pytest.raises(CorrectionConfigError, match=message):
            C.from_peer_names(**kwargs)


def test_trl_clip_max_null_and_absent_through_jsonargparse():
    """In YAML, a null clip_max is "no upper bound" and an absent one TRL's default; the config they
    build is dumped as LightningCLI saves it (``skip_none=False``) and loads back to the same config."""
    from jsonargparse import ArgumentParser

    def build(correction: C | None = None) -> C | None:
        return correction

    parser = ArgumentParser()
    parser.add_function_arguments(build, "run")
    for text, cap in (
        ("vllm_importance_sampling_mode: token_mask\n", 3.0),
        ("vllm_importance_sampling_mode: token_mask\nvllm_importance_sampling_clip_max: null\n", math.inf),
    ):
        with pytest.warns(PeerNameWarning):
            built = C.from_peer_names(**yaml.safe_load(text))
        assert built.tis_clip_high == cap
        namespace = parser.parse_object({"run": {"correction": built.to_dict()}})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # jsonargparse renames skip_none; Lightning passes it
            dumped = yaml.safe_load(parser.dump(namespace, skip_none=False))
        reloaded = parser.parse_object(dumped)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # kit names only: nothing maps again
            assert parser.instantiate(reloaded).run.correction == built


def _verl_k3(logprob: float, ref_logprob: float) -> float:
    """verl's ``kl_penalty_forward(..., "k3")`` (its "low_var_kl" branch), SkyRL's ``compute_approx_kl("k3")``."""
    kl = min(max(ref_logprob - logprob, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1.0, -10.0), 10.0)


def test_the_peers_k3_is_the_kits_low_var_kl():
    d = torch.tensor([-30.0, -15.0, -3.0, -0.5, 0.0, 0.7, 4.0, 25.0], dtype=torch.float64)
    peer = np.array([_verl_k3(float(x), 0.0) for x in d])
    np.testing.assert_allclose(kl_of_log_ratio(d, "low_var_kl").numpy(), peer, rtol=1e-12, atol=0.0)
    assert not np.allclose(kl_of_log_ratio(d, "k3").numpy(), peer), "the kit's k3 does not clamp: another estimator"


def _verl_vanilla_token_mean(logprob, old, adv, mask, clip=0.2, clip_c=3.0) -> float:
    """verl's ``compute_policy_loss_vanilla`` with ``loss_agg_mode="token-mean"``: always dual-clipped."""
    total = 0.0
    for i in range(logprob.shape[0]):
        for t in range(logprob.shape[1]):
            if not mask[i, t]:
                continue
            a = float(adv[i, t])
            ratio = math.exp(min(max(float(logprob[i, t]) - float(old[i, t]), -20.0), 20.0))
            clip_pg_losses1 = max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip))
            loss = min(-a * clip_c, clip_pg_losses1) if a < 0 else clip_pg_losses1
            total += loss
    return total / float(mask.sum())


def test_verls_ppo_loss_is_the_kits_with_dual_clip_3():
    old = np.array([[-1.0, -2.0, -0.5, -1.5]])
    logprob = old + np.array([[1.8, -0.4, 0.1, 2.5]])  # ratios e^1.8 and e^2.5 above 3 with A < 0
    adv = np.array([[-1.0, 0.5, 2.0, -0.7]])
    mask = np.ones_like(old)
    verl = _verl_vanilla_token_mean(logprob, old, adv, mask)
    args = (_f32(logprob), _f32(old), None, _f32(adv), _f32(mask))
    dual, _ = policy_loss(*args, PolicyLossConfig(dual_clip=3.0))
    plain, _ = policy_loss(*args, PolicyLossConfig())
    assert float(dual) == pytest.approx(verl, rel=1e-6)
    assert float(plain) != pytest.approx(verl, rel=1e-3), "without the dual clip the loss is not verl's"


def _skyrl_token_mean_icepop(logprob, old, rollout, adv, mask, low, high, clip=0.2) -> float:
    """SkyRL's ``ppo_policy_loss`` (regular) with its token mask and ``loss_reduction="token_mean"``.

    ``apply_loss_reduction_to_advantages_minibatch`` divides the advantages by the response tokens
    before any correction; ``reduce_loss`` then sums the loss over the corrected mask.
    """
    corrected = _skyrl_token_mask(old, rollout, mask, low, high)
    n = float(mask.sum())
    total = 0.0
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            a = float(adv[i, t]) / n
            ratio = _skyrl_safe_exp(float(logprob[i, t]) - float(old[i, t]))
            total += -min(ratio * a, min(max(ratio, 1 - clip), 1 + clip) * a) * corrected[i, t]
    return total


def test_skyrl_keeps_rejected_tokens_in_the_denominator_as_the_kit_does():
    rollout = np.full(SKYRL_LOG_RHO.shape, -1.5)
    old = rollout + SKYRL_LOG_RHO
    logprob = old + np.array([[0.05, -0.1, 0.3, 0.0], [-0.2, 0.1, 0.02, -0.05]])
    adv = np.array([[1.0, -0.5, 0.3, 2.0], [-1.0, 0.4, -0.2, 0.8]])
    mask = np.ones_like(old)
    skyrl = _skyrl_token_mean_icepop(logprob, old, rollout, adv, mask, 0.5, 2.0)
    correction = compute_correction(_f32(old), _f32(rollout), _f32(mask), C.token_mis(0.5, 2.0))
    assert 0 < float(correction.mask.sum()) < mask.sum()
    kit, _ = policy_loss(_f32(logprob), _f32(old), _f32(rollout), _f32(adv), _f32(mask), correction=correction)
    assert float(kit) == pytest.approx(skyrl, rel=1e-6)


def test_docs_state_the_peer_differences_the_peers_code_shows():
    text = (ROOT / "docs" / "off_policy_correction.md").read_text()
    section = text.split("## 8. The peers' config names and presets", 1)[1]
    assert "verl and SkyRL drop" not in section
    assert "#1296" in section, "SkyRL keeps rejected tokens in the denominator since its PR #1296"
    assert "`low_var_kl`" in section and "`k3`" in section
    assert "dual_clip=3.0" in section
    assert "both" in section.split("token_mask_is_threshold_low / _high", 1)[1].split("\n", 1)[0]
    assert "no upper bound" in section


# ------------------------------------------------------------------ the policy loss's peer names
# verl 1dda039 (verl/workers/config/actor.py ActorConfig, verl/trainer/ppo/core_algos.py
# compute_policy_loss_dppo_tv / _kl), SkyRL a956457 (skyrl/train/config/config.py DPPOConfig,
# ppo_utils.py dppo_policy_loss), prime-rl 559b447 (packages/prime-rl-configs/.../trainer.py
# DefaultLossConfig, src/prime_rl/trainer/rl/loss.py default_loss_fn). Their loss and gradient
# against the kit's: tests/test_dppo.py.
@pytest.mark.parametrize(
    ("peer", "names", "expected"),
    [
        ("verl", dict(loss_mode="dppo_tv"), dict(loss_type="dppo_tv", dppo_ratio_cap=3.0)),  # ActorConfig defaults
        (
            "verl",  # verl's examples/dppo_trainer script for dppo_kl
            dict(loss_mode="dppo_kl", clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=10000.0),
            dict(loss_type="dppo_kl", dppo_delta_low=0.05, dppo_delta_high=0.05, dppo_ratio_cap=10000.0),
        ),
        ("verl", dict(loss_mode="vanilla", clip_ratio_high=0.28), dict(eps_clip_high=0.28, dual_clip=3.0)),
        ("verl", dict(clip_ratio_low=0.1, clip_ratio_c=2.0), dict(eps_clip_low=0.1, dual_clip=2.0)),  # vanilla default
        ("SkyRL", dict(policy_loss_type="dppo"), dict(loss_type="dppo_tv")),  # DPPOConfig defaults
        (
            "SkyRL",
            dict(policy_loss_type="dppo", dppo_type="binary_kl", delta_low=0.05, delta_high=0.1),
            dict(loss_type="dppo_kl", dppo_delta_low=0.05, dppo_delta_high=0.1),
        ),
        ("SkyRL", dict(policy_loss_type="regular"), dict()),
        (
            "prime-rl",  # DefaultLossConfig defaults: masks 0.2 / 0.2, kl_tau 1e-3, adv_tau 1.0
            dict(dppo_mask_low=0.2),
            dict(loss_type="dppo_tv", rollout_kl_coef=2e-3, rollout_kl_estimator="k2"),
        ),
        (
            "prime-rl",
            dict(dppo_mask_high=0.1, kl_tau=0.0, adv_tau=1.0),
            dict(loss_type="dppo_tv", dppo_delta_high=0.1, rollout_kl_coef=0.0),
        ),
    ],
)
def test_policy_loss_peer_names(peer, names, expected):
    from lightning_offpolicy.correction.peer_names import LOSS_PEER_OF

    with pytest.warns(PeerNameWarning, match=f"^{peer}'s .* the kit's") as caught:
        built = PolicyLossConfig.from_peer_names(**names)
    assert built == PolicyLossConfig(**expected)
    assert not any(hasattr(built, name) for name in LOSS_PEER_OF), "peer names are no fields of the config"
    if expected.get("loss_type", "ppo").startswith("dppo") and peer != "verl":
        assert "bypass_mode: true" in str(caught[0].message), "SkyRL / prime-rl divide by pi_rollout: say so"


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (dict(loss_mode="dppo_tv", delta_low=0.1), "SkyRL and verl are mixed"),
        (dict(clip_ratio=0.1), "clip_ratio only where clip_ratio_low / clip_ratio_high are null"),
        (dict(loss_mode="gspo"), "loss_mode='gspo' is not mapped"),
        (dict(delta_low=0.1), r"only with policy_loss_type: dppo"),
        (dict(policy_loss_type="dppo", dppo_type="topk_tv"), "dppo_type='topk_tv' is not one of"),
        (dict(policy_loss_type="cispo"), "policy_loss_type='cispo' is not mapped"),
        (dict(adv_tau=0.5), "adv_tau=0.5 multiplies the advantages"),
        (dict(kl_tau=1e-3, rollout_kl_coef=0.5), "rollout_kl_coef=0.5 conflicts"),
        (dict(dppo_mask_low=-0.1), "dppo_mask_low=-0.1 must be a finite number >= 0"),
        (dict(loss_mode="vanilla", clip_ratio_c=1.0), r"dual_clip=1.0 must be greater than 1"),  # verl asserts > 1 too
    ],
)
def test_policy_loss_peer_names_refused_with_how(names, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeerNameWarning)
        with pytest.raises(CorrectionConfigError, match=message):
            PolicyLossConfig.from_peer_names(**names)


def test_prime_rl_loss_table_from_yaml_round_trips():
    import dataclasses

    text = """
dppo_mask_low: 0.2
dppo_mask_high: 0.2
kl_tau: 1.0e-3
adv_tau: 1.0
"""
    with pytest.warns(PeerNameWarning, match="prime-rl's"):
        cfg = PolicyLossConfig.from_peer_names(**yaml.safe_load(text))
    assert (cfg.loss_type, cfg.rollout_kl_coef, cfg.rollout_kl_estimator) == ("dppo_tv", 2e-3, "k2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a copy maps nothing again
        assert PolicyLossConfig(**dataclasses.asdict(cfg)) == cfg
        assert dataclasses.replace(cfg) == cfg


def test_from_peer_names_refuses_an_unknown_key_by_name():
    with pytest.raises(CorrectionConfigError, match=r"from_peer_names: 'rollout_iss' is neither a peer's setting"):
        C.from_peer_names(rollout_iss="token")
    with pytest.raises(CorrectionConfigError, match=r"from_peer_names: 'clip_ratio_lo' is neither"):
        PolicyLossConfig.from_peer_names(clip_ratio_lo=0.2)
    with pytest.raises(TypeError, match="rollout_is"):
        C(rollout_is="token")  # the dataclass takes the kit's names only

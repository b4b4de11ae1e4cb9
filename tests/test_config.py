"""OffPolicyCorrectionConfig / PolicyLossConfig validation, presets and deprecated spellings."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch

from lightning_offpolicy.correction import (
    PRESETS,
    CorrectionConfigError,
    OffPolicyCorrectionConfig,
    PolicyLossConfig,
    check_compatible,
    compute_correction,
    policy_loss,
    preset,
)

C = OffPolicyCorrectionConfig
P = PolicyLossConfig
INF, NAN = float("inf"), float("nan")


def raises_naming(setting: str):
    """pytest.raises(CorrectionConfigError) whose message names ``setting`` as a whole word."""
    return pytest.raises(CorrectionConfigError, match=rf"\b{re.escape(setting)}\b")


def test_error_type_is_a_value_error():
    assert issubclass(CorrectionConfigError, ValueError)


# ------------------------------------------------------------------------------ unknown choices
@pytest.mark.parametrize(
    "cls, kwargs, setting",
    [
        (C, dict(tis_level="tokens"), "tis_level"),
        (C, dict(tis_level="Token"), "tis_level"),
        (C, dict(objective="grpo"), "objective"),
        (C, dict(objective_level="batch"), "objective_level"),
        (C, dict(anchor="theta"), "anchor"),
        (C, dict(kl_reject="k4", kl_reject_threshold=0.1), "kl_reject"),
        (C, dict(kl_reject="k3", kl_reject_level="seq_median", kl_reject_threshold=0.1), "kl_reject_level"),
        (P, dict(loss_type="dapo"), "loss_type"),
        (P, dict(aggregation="token-sum"), "aggregation"),
        (P, dict(aggregation="seq_mean_token_mean"), "aggregation"),
        (P, dict(rollout_kl_estimator="k4"), "rollout_kl_estimator"),
        (P, dict(ref_kl_estimator="mse"), "ref_kl_estimator"),
    ],
)
def test_unknown_choice_names_the_setting_and_the_choices(cls, kwargs, setting):
    with raises_naming(setting) as err:
        cls(**kwargs)
    message = str(err.value)
    assert cls.__name__ in message
    assert repr(kwargs[setting]) in message, "the message shows the bad value"
    assert "allowed" in message


def test_unknown_choice_lists_the_allowed_values():
    with pytest.raises(CorrectionConfigError) as err:
        P(aggregation="token-sum")
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert mode in str(err.value)
    with pytest.raises(CorrectionConfigError) as err:
        P(ref_kl_estimator="mse")
    for est in ("k1", "abs", "k2", "k3", "low_var_kl"):
        assert est in str(err.value)


# ------------------------------------------------------------------------------ missing thresholds
@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(tis_level="token", tis_clip_high=None), "tis_clip_high"),
        (dict(tis_level="sequence", tis_clip_high=None), "tis_clip_high"),
        (dict(kl_reject="k3"), "kl_reject_threshold"),
        (dict(kl_reject="k1", kl_reject_level="token"), "kl_reject_threshold"),
        (dict(objective="pure_is", bypass_mode=True, is_clip_high=None), "is_clip_high"),
        (dict(objective="pure_is", is_clip_high=None), "is_clip_high"),
        (dict(objective="cispo", is_clip_high=None), "is_clip_high"),
        (dict(objective="cispo", anchor="prox", is_clip_high=None), "is_clip_high"),
    ],
)
def test_missing_threshold(kwargs, setting):
    with raises_naming(setting):
        C(**kwargs)


@pytest.mark.parametrize("setting", ["tis_clip_low", "normalize_weights"])
def test_weight_options_without_tis_level(setting):
    kwargs = {"tis_clip_low": 0.5} if setting == "tis_clip_low" else {"normalize_weights": True}
    with raises_naming(setting):
        C(**kwargs)


# ------------------------------------------------------------------------------ bounds
BOUND_PAIRS = [
    (dict(tis_level="token"), "tis_clip_low", "tis_clip_high"),
    (dict(tis_level="sequence"), "tis_clip_low", "tis_clip_high"),
    (dict(token_mask=True), "token_mask_low", "token_mask_high"),
    (dict(geo_mask=True), "geo_mask_low", "geo_mask_high"),
    (dict(product_mask=True), "product_mask_low", "product_mask_high"),
    (dict(outlier_token_veto=True), "outlier_low", "outlier_high"),
    (dict(objective="cispo"), "is_clip_low", "is_clip_high"),
    (dict(objective="pure_is", bypass_mode=True), "is_clip_low", "is_clip_high"),
]


@pytest.mark.parametrize("enable, low, high", BOUND_PAIRS, ids=[f"{lo}>{hi}" for _, lo, hi in BOUND_PAIRS])
def test_low_greater_than_high(enable, low, high):
    with raises_naming(low) as err:
        C(**enable, **{low: 3.0, high: 2.0})
    assert high in str(err.value)
    # equal bounds are allowed (a point interval), and so is low < high
    C(**enable, **{low: 2.0, high: 2.0})
    C(**enable, **{low: 0.5, high: 2.0})


POSITIVE_SETTINGS = [
    (dict(tis_level="token"), "tis_clip_high"),
    (dict(tis_level="sequence"), "tis_clip_high"),
    (dict(tis_level="token", tis_clip_high=1e9), "tis_clip_low"),
    (dict(token_mask=True, token_mask_high=1e9), "token_mask_low"),
    (dict(token_mask=True), "token_mask_high"),
    (dict(geo_mask=True, geo_mask_high=1e9), "geo_mask_low"),
    (dict(geo_mask=True), "geo_mask_high"),
    (dict(product_mask=True, product_mask_high=1e9), "product_mask_low"),
    (dict(product_mask=True), "product_mask_high"),
    (dict(outlier_token_veto=True, outlier_high=1e9), "outlier_low"),
    (dict(outlier_token_veto=True), "outlier_high"),
    (dict(kl_reject="k3"), "kl_reject_threshold"),
    (dict(objective="cispo"), "is_clip_high"),
    (dict(objective="cispo", is_clip_high=1e9), "is_clip_low"),
    (dict(objective="pure_is", bypass_mode=True), "is_clip_high"),
]


@pytest.mark.parametrize("bad", [0.0, -1.0, INF, NAN, "2.0"], ids=["zero", "negative", "inf", "nan", "string"])
@pytest.mark.parametrize("enable, setting", POSITIVE_SETTINGS, ids=[s for _, s in POSITIVE_SETTINGS])
def test_non_positive_or_non_finite_cap(enable, setting, bad):
    if setting == "tis_clip_high" and bad == INF:
        # inf is the uncapped weight (TRL's vllm_importance_sampling_clip_max=None): accepted.
        assert C(**{**enable, setting: bad}).tis_clip_high == INF
        return
    with raises_naming(setting):
        C(**{**enable, setting: bad})


@pytest.mark.parametrize("setting", ["eps_clip_low", "eps_clip_high", "tau_pos", "tau_neg", "loss_norm_constant"])
@pytest.mark.parametrize("bad", [0.0, -0.1, INF, NAN], ids=["zero", "negative", "inf", "nan"])
def test_loss_positive_settings(setting, bad):
    with raises_naming(setting):
        P(**{setting: bad})


@pytest.mark.parametrize("value", [1.0, 1.5, 2.0])
def test_eps_clip_low_must_be_below_one(value):
    with raises_naming("eps_clip_low"):
        P(eps_clip_low=value)
    P(eps_clip_low=0.99)
    P(eps_clip_high=value)  # the upper clip has no such limit (DAPO clip-higher)


@pytest.mark.parametrize("value", [1.0, 0.5, 0.0, -3.0, INF, NAN])
def test_dual_clip_must_exceed_one(value):
    with raises_naming("dual_clip"):
        P(dual_clip=value)
    P(dual_clip=1.0001)
    P(dual_clip=None)


@pytest.mark.parametrize("setting", ["rollout_kl_coef", "ref_kl_coef"])
@pytest.mark.parametrize("bad", [-0.1, -1e-9, INF, NAN])
def test_kl_coef_must_be_finite_and_non_negative(setting, bad):
    with raises_naming(setting):
        P(**{setting: bad})
    P(**{setting: 0.0})
    P(**{setting: 0.5})


def test_replace_validates():
    cfg = C.token_tis(clip_high=2.0)
    with raises_naming("tis_clip_high"):
        cfg.replace(tis_clip_high=-1.0)
    assert cfg.replace(tis_clip_high=3.0).tis_clip_high == 3.0


# ------------------------------------------------------------------------------ double correction
@pytest.mark.parametrize("tis_level", ["token", "sequence"])
def test_tis_with_pure_is_is_double_correction(tis_level):
    with raises_naming("tis_level") as err:
        C(tis_level=tis_level, objective="pure_is")
    assert "double correction" in str(err.value)
    assert "pure_is" in str(err.value)


@pytest.mark.parametrize("tis_level", ["token", "sequence"])
def test_tis_with_cispo_on_rollout_is_double_correction(tis_level):
    with raises_naming("tis_level") as err:
        C(tis_level=tis_level, objective="cispo", anchor="rollout")
    assert "double correction" in str(err.value)
    # anchored on prox, the TIS weight corrects pi_prox vs pi_rollout once: allowed
    cfg = C(tis_level=tis_level, objective="cispo", anchor="prox")
    assert cfg.tis_level == tis_level and cfg.anchor == "prox"


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(tis_level="token"), "already is the importance weight"),
        (dict(tis_level="sequence", objective="reinforce"), "objective='pure_is' with objective_level='sequence'"),
    ],
)
def test_bypass_with_a_weight_is_double_counting(kwargs, fix):
    with raises_naming("bypass_mode") as err:
        C(bypass_mode=True, **kwargs)
    assert "tis_level" in str(err.value) and fix in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(token_mask=True),
        dict(geo_mask=True),
        dict(product_mask=True),
        dict(outlier_token_veto=True),
        dict(kl_reject="k3", kl_reject_threshold=0.01),
        dict(kl_reject="k2", kl_reject_level="token", kl_reject_threshold=0.01),
        dict(geo_mask=True, objective="pure_is", objective_level="sequence"),
        dict(token_mask=True, objective="reinforce"),
    ],
)
def test_bypass_with_a_mask_compares_the_current_policy(kwargs):
    cfg = C(bypass_mode=True, **kwargs)
    assert cfg.masks_read_current_policy and not cfg.needs_prox
    prox, current = torch.zeros(1, 2), torch.ones(1, 2, requires_grad=True)
    numerator = cfg.ratio_numerator(prox, current)
    assert torch.equal(numerator, current.detach()) and not numerator.requires_grad
    assert C(bypass_mode=True).ratio_numerator(prox, current) is None
    assert C().ratio_numerator(prox, current) is prox


def test_bypass_with_cispo_on_prox():
    with raises_naming("bypass_mode") as err:
        C(bypass_mode=True, objective="cispo", anchor="prox")
    assert "anchor" in str(err.value)
    C(bypass_mode=True, objective="cispo", anchor="rollout")
    C(bypass_mode=True, objective="pure_is")


@pytest.mark.parametrize("objective", ["pure_is", "cispo"])
@pytest.mark.parametrize("loss_type", ["gspo", "sapo"])
def test_check_compatible(objective, loss_type):
    cfg = C(objective=objective, bypass_mode=objective == "pure_is")
    with raises_naming("loss_type") as err:
        check_compatible(cfg, P(loss_type=loss_type))
    assert objective in str(err.value)
    check_compatible(cfg, P(loss_type="ppo"))
    check_compatible(C.token_tis(), P(loss_type=loss_type))
    # policy_loss refuses it too, before computing anything
    x = torch.zeros(1, 2)
    corr = compute_correction(x, x, torch.ones(1, 2), cfg)
    with raises_naming("loss_type"):
        policy_loss(x, x, x, x, torch.ones(1, 2), P(loss_type=loss_type), correction=corr)


# ------------------------------------------------------------------------------ removed spellings
@pytest.mark.parametrize(
    ("old", "new"), [(dict(use_tis=True), "tis_level='token'"), (dict(tis_imp_ratio_cap=3.0), "tis_clip_high")]
)
def test_removed_spellings_are_refused_naming_the_new_one(old, new):
    # No release shipped them: the config takes the new names only, and from_peer_names names the new one.
    with pytest.raises(TypeError, match=next(iter(old))):
        C(**old)
    with raises_naming(next(iter(old))) as err:
        C.from_peer_names(**old)
    assert f"was removed; use {new}" in str(err.value)


def test_new_spellings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for build in PRESETS.values():
            build()
        C.token_tis(clip_high=3.0).replace(tis_clip_high=4.0)
        P()


# ------------------------------------------------------------------------------ presets
CONTRACT_PRESETS = [
    "disabled",
    "token_tis",
    "token_mis",
    "seq_tis",
    "seq_mis",
    "geo_mis",
    "geo_rs",
    "seq_tis_geo_rs",
    "outlier_veto",
    "bypass",
    "pure_is",
    "cispo",
]


def test_contract_presets_exist():
    for name in CONTRACT_PRESETS:
        assert name in PRESETS, name
        assert callable(getattr(C, name)), name


def test_unknown_preset():
    with pytest.raises(CorrectionConfigError, match="token-tis") as err:
        preset("token-tis")
    assert "token_tis" in str(err.value), "the message lists the known presets"
    with pytest.raises(CorrectionConfigError, match="nope"):
        preset("nope")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_and_round_trips(name):
    cfg = preset(name)
    assert isinstance(cfg, C)
    assert cfg == PRESETS[name]()
    cfg.validate()
    d = cfg.to_dict()
    assert "use_tis" not in d and "tis_imp_ratio_cap" not in d
    json.dumps(d)  # plain values only (YAML / hyperparameter logging)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = C(**d)
    assert again == cfg
    assert again.to_dict() == d


def test_preset_keywords():
    cfg = preset("geo_mis", low=0.98)
    assert (cfg.geo_mask, cfg.geo_mask_low, cfg.geo_mask_high) == (True, 0.98, 1.01)
    cfg = C.token_tis(clip_high=2.5, clip_low=0.5)
    assert (cfg.tis_level, cfg.tis_clip_high, cfg.tis_clip_low) == ("token", 2.5, 0.5)
    cfg = C.seq_tis(clip_high=3.0)
    assert (cfg.tis_level, cfg.tis_clip_high) == ("sequence", 3.0)
    cfg = C.geo_mis(low=0.97, high=1.03)
    assert (cfg.geo_mask, cfg.geo_mask_low, cfg.geo_mask_high) == (True, 0.97, 1.03)
    assert C.geo_rs(low=0.97, high=1.03) == cfg
    cfg = C.seq_mis(low=0.4, high=2.5)
    assert (cfg.product_mask, cfg.product_mask_low, cfg.product_mask_high) == (True, 0.4, 2.5)
    cfg = C.token_mis(low=0.6, high=1.7)
    assert (cfg.token_mask, cfg.token_mask_low, cfg.token_mask_high) == (True, 0.6, 1.7)
    cfg = C.outlier_veto(low=1e-3, high=50.0)
    assert (cfg.outlier_token_veto, cfg.outlier_low, cfg.outlier_high) == (True, 1e-3, 50.0)
    assert C.bypass().bypass_mode and not C.bypass().needs_prox
    cfg = C.pure_is(clip_high=3.0, level="sequence")
    assert (cfg.objective, cfg.objective_level, cfg.is_clip_high) == ("pure_is", "sequence", 3.0)
    cfg = C.cispo(clip_high=1.3, clip_low=0.7, anchor="prox")
    assert (cfg.objective, cfg.anchor, cfg.is_clip_low, cfg.is_clip_high) == ("cispo", "prox", 0.7, 1.3)
    assert C.disabled() == C()
    assert C.disabled().mask_names == [] and C.disabled().tis_level is None


@pytest.mark.parametrize(
    "name, kwargs, setting",
    [
        ("token_tis", dict(clip_high=0.0), "tis_clip_high"),
        ("geo_mis", dict(low=1.2, high=1.1), "geo_mask_low"),
        ("seq_mis", dict(low=-1.0), "product_mask_low"),
        ("outlier_veto", dict(high=NAN), "outlier_high"),
        ("cispo", dict(clip_high=INF), "is_clip_high"),
        ("decoupled_k3_rs", dict(threshold=0.0), "kl_reject_threshold"),
    ],
)
def test_presets_validate_their_keywords(name, kwargs, setting):
    with raises_naming(setting):
        preset(name, **kwargs)


def test_loss_config_defaults_are_valid():
    cfg = P()
    assert cfg.loss_type == "ppo" and cfg.aggregation == "token-mean"
    assert math.isclose(cfg.eps_clip_low, 0.2) and cfg.dual_clip is None


def test_the_docs_preset_table_matches_the_code():
    # docs/off_policy_correction.md lists every preset with its defaults; the values live in presets.py.
    import inspect
    from pathlib import Path

    from lightning_offpolicy.correction.presets import PRESET_METHODS

    text = (Path(__file__).resolve().parents[1] / "docs" / "off_policy_correction.md").read_text()
    table = text.split("| Preset | Sets |", 1)[1].split("\n\n", 1)[0]
    documented = {}
    for row in table.splitlines()[2:]:
        name, args = re.match(r"\| `(\w+)\((.*?)\)`", row).groups()
        documented[name] = eval(f"dict({args})")  # the defaults as written, e.g. low=1/1.001
        for alias in re.findall(r"alias `(\w+)`", row.split("|")[1]):
            assert PRESET_METHODS[alias] == name, alias
    assert set(documented) == set(PRESET_METHODS.values())
    for name, defaults in documented.items():
        parameters = inspect.signature(getattr(C, name)).parameters.values()
        assert defaults == {p.name: p.default for p in parameters}, name

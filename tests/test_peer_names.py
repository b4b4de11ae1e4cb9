"""The peers' config names (verl, SkyRL, TRL) mapped to the kit's, or refused with the kit's equivalent.

``VERL_PRESETS`` is verl's rollout-correction preset list (``RolloutCorrectionConfig`` classmethods
in verl/trainer/config/algorithm.py at verl-project/verl 1dda039), field for field. Every one of
them is expressible in the kit: given with verl's names it either builds the kit config directly,
or (the signed k1 modes, whose ratio is the reciprocal of the kit's) is refused with a message
whose settings build it.
"""

from __future__ import annotations

import re
import warnings

import pytest
import yaml

from lightning_offpolicy.correction import CorrectionConfigError
from lightning_offpolicy.correction import OffPolicyCorrectionConfig as C
from lightning_offpolicy.correction.peer_names import PEER_OF, PeerNameWarning

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
            built = C(**verl)
        except CorrectionConfigError as err:
            # The signed k1 modes: refused, with the kit's settings for the same rejection.
            assert "k1" in str(err) and "reciprocal" in str(err), err
            kept = {k: v for k, v in verl.items() if not k.startswith("rollout_rs")}
            built = C(**kept, **_settings_of(str(err)))
    assert built == expected, (name, built.to_dict(), expected.to_dict())
    messages = [str(w.message) for w in caught if issubclass(w.category, PeerNameWarning)]
    assert all(message.startswith("verl's") and "the kit's" in message for message in messages), messages
    for field in PEER_OF:
        assert getattr(built, field) is None


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
        (dict(token_mask_is_threshold_high=3.0), C(token_mask=True, token_mask_low=None, token_mask_high=3.0)),
    ],
)
def test_skyrl_names(skyrl, expected):
    with pytest.warns(PeerNameWarning, match="SkyRL's .* the kit's"):
        assert C(**skyrl) == expected


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
        assert C(**trl) == expected
    with pytest.warns(PeerNameWarning, match="is the kit's default"):
        assert C(vllm_importance_sampling_correction=False) == C()


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
        (dict(outlier_token_is_threshold_high=100.0, token_mask_is_threshold_high=2.0), "before its token mask"),
        (dict(tis_ratio_type="tokens"), "not one of"),
    ],
)
def test_differences_are_refused_with_how(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PeerNameWarning)
        with pytest.raises(CorrectionConfigError, match=message):
            C(**kwargs)


def test_peer_names_from_yaml_and_round_trip():
    text = """
rollout_is: token
rollout_is_threshold: 2.0
rollout_rs: seq_mean_k3
rollout_rs_threshold: 0.01
"""
    with pytest.warns(PeerNameWarning):
        cfg = C(**yaml.safe_load(text))
    assert cfg == C(tis_level="token", tis_clip_high=2.0, **K3)
    assert not set(cfg.to_dict()) & set(PEER_OF), "peer names never reach a saved config"
    assert C(**cfg.to_dict()) == cfg

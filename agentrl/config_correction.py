"""The rollout correction's presets (peers' published defaults) and the settings that the
`algo.rollout_*` fields resolve to; `trainer/rollout_correction.py` turns them into weights and
masks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from agentrl.config import AlgoConfig

PresetName = Literal["token_tis", "seq_tis", "seq_mis", "geo_rs", "geo_rs_seq_tis", "icepop"]
DEFAULT_IS_THRESHOLD = 2.0  # verl's rollout_is_threshold default (TIS's cap)


# Peers' published defaults. verl: `RolloutCorrectionConfig` factory methods
# (verl/trainer/config/algorithm.py); IcePop: ratio kept in [0.5, 5] (NeMo-RL's `icepop`,
# AReaL's IcePop), the weight itself applied inside the band.


@dataclass(frozen=True)
class CorrectionSettings:
    """What `algo.rollout_*` ask for once resolved: levels (None = off) and bounds."""

    rollout_is: str | None = None
    rollout_is_threshold: float = DEFAULT_IS_THRESHOLD
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None  # None = 1 / rollout_rs_threshold
    rollout_token_veto_threshold: float | None = None


PRESETS: dict[PresetName, CorrectionSettings] = {
    # verl decoupled_token_is / slime TIS
    "token_tis": CorrectionSettings(rollout_is="token"),
    # verl decoupled_seq_is
    "seq_tis": CorrectionSettings(rollout_is="sequence"),
    # verl decoupled_seq_is_rs (Seq-MIS)
    "seq_mis": CorrectionSettings(
        rollout_is="sequence", rollout_rs="sequence", rollout_rs_threshold=2.0
    ),
    # verl decoupled_geo_rs
    "geo_rs": CorrectionSettings(
        rollout_rs="geometric", rollout_rs_threshold=1.001, rollout_token_veto_threshold=1e-4
    ),
    # verl geo_rs_seq_tis
    "geo_rs_seq_tis": CorrectionSettings(
        rollout_is="sequence",
        rollout_rs="geometric",
        rollout_rs_threshold=1.001,
        rollout_token_veto_threshold=1e-4,
    ),
    # IcePop: token ratio outside [0.5, 5] masked, inside it weighs the token
    "icepop": CorrectionSettings(
        rollout_is="token",
        rollout_is_threshold=5.0,
        rollout_rs="token",
        rollout_rs_threshold=5.0,
        rollout_rs_threshold_lower=0.5,
    ),
}


def settings_from_config(cfg: AlgoConfig) -> CorrectionSettings:
    """The preset `cfg.rollout_correction` names, then each `algo.rollout_*` field that is set;
    `use_tis` (slime's flag) is token-level IS truncated at `tis_cap` when no level is given."""
    preset = cfg.rollout_correction
    base = PRESETS[preset] if preset is not None else CorrectionSettings()
    rollout_is = cfg.rollout_is or base.rollout_is
    is_threshold = cfg.rollout_is_threshold or base.rollout_is_threshold
    if rollout_is is None and cfg.use_tis:
        rollout_is = "token"
        is_threshold = cfg.rollout_is_threshold or cfg.tis_cap
    return CorrectionSettings(
        rollout_is=rollout_is,
        rollout_is_threshold=is_threshold,
        rollout_rs=cfg.rollout_rs or base.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold or base.rollout_rs_threshold,
        rollout_rs_threshold_lower=(
            cfg.rollout_rs_threshold_lower or base.rollout_rs_threshold_lower
        ),
        rollout_token_veto_threshold=(
            cfg.rollout_token_veto_threshold or base.rollout_token_veto_threshold
        ),
    )

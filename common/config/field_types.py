"""The mode aliases as the config dataclasses' annotations name them (``method: SpecMethod``).

For type checkers each name is the ``Literal`` alias of :mod:`common.config.modes`. At run time
each is ``str``: OmegaConf 2.3, which builds Hydra's schema from these annotations
(``load_config``, ``to_yaml``), refuses a ``Literal`` annotation ("Unexpected type
annotation"), so it sees a ``str`` field, merges and converts overrides as before, and the
section's ``__post_init__`` refuses a value outside the alias's tuple with a message that quotes
it. Code that wants the values at run time reads the tuples (or the aliases) of ``modes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "ChatTemplateMode",
    "CheckpointFormat",
    "DatasetFormat",
    "EngineName",
    "InflightMode",
    "LearnerProfile",
    "LossAggregation",
    "LrSchedule",
    "ModelImpl",
    "NgramSource",
    "OverlongMode",
    "Precision",
    "PublishDtype",
    "PublishUpload",
    "RatioLevel",
    "RewardFailureMode",
    "SpecMethod",
    "TaskName",
    "TorchDtype",
    "VllmWeightTransfer",
]

if TYPE_CHECKING:
    from common.config.modes import (
        ChatTemplateMode,
        CheckpointFormat,
        DatasetFormat,
        EngineName,
        InflightMode,
        LearnerProfile,
        LossAggregation,
        LrSchedule,
        ModelImpl,
        NgramSource,
        OverlongMode,
        Precision,
        PublishDtype,
        PublishUpload,
        RatioLevel,
        RewardFailureMode,
        SpecMethod,
        TaskName,
        TorchDtype,
        VllmWeightTransfer,
    )
else:
    ChatTemplateMode = DatasetFormat = EngineName = InflightMode = LearnerProfile = str
    ModelImpl = NgramSource = Precision = PublishDtype = PublishUpload = str
    SpecMethod = TaskName = TorchDtype = str
    CheckpointFormat = VllmWeightTransfer = str
    LossAggregation = LrSchedule = OverlongMode = RatioLevel = RewardFailureMode = str

"""mmgrpo: one correct, tested, composable group-relative policy optimisation core for generators, VLMs and video LLMs.

Public API: `train`, `Config`, `load_config` and the registries; the maths lives in advantages, losses, sampling.
"""

from mmgrpo import preference, reinforce  # noqa: F401  register DPO + verifier_pairs, and dispo
from mmgrpo.advantages import ADVANTAGES
from mmgrpo.config import Config, load_config
from mmgrpo.losses import AGGREGATIONS, KL, POLICY_LOSSES
from mmgrpo.plugins import PIPELINES
from mmgrpo.reward import REWARDS
from mmgrpo.sampling import SAMPLERS


def train(cfg: Config):
    """Run training as configured (see mmgrpo.trainer.train)."""
    # lazy: the trainer imports accelerate; `import mmgrpo` stays light
    from mmgrpo.trainer import train as _train

    return _train(cfg)


__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL",
    "PIPELINES",
    "POLICY_LOSSES",
    "REWARDS",
    "SAMPLERS",
    "Config",
    "load_config",
    "train",
]
__version__ = "0.1.0"

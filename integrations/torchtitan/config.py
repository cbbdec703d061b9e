"""The ``[upipe]`` section of a torchtitan job TOML.

torchtitan 0.2.2 merges a user dataclass into its JobConfig when the TOML names it:

    [job]
    custom_config_module = "upipe_compile.integrations.torchtitan.config"

    [upipe]
    heads_per_stage = 0         # U; 0 = P (one head per rank per stage, least memory)
    inner_backend = "inductor"  # what compiles each block after the UPipe rewrite
    prefetch = "forward"        # overlap the next stage's all-to-alls: none | forward | both

Without that line the section is unknown to torchtitan's ConfigManager (it rejects the TOML),
and the integration uses the defaults below.
"""


from dataclasses import dataclass, field


@dataclass
class UPipe:
    heads_per_stage: int = 0
    """U: query heads per stage across the CP ranks, a multiple of the CP degree P.
    0 means U = P (least attention memory); U = number of query heads is plain Ulysses."""

    inner_backend: str = "inductor"
    """What compiles each TransformerBlock after the UPipe passes (and the loss, when
    [compile] components has "loss"): "inductor", "aot_eager" or "eager"."""

    prefetch: str = "forward"
    """Start the next stage's all-to-alls during this stage's attention: "forward" (no extra
    peak memory for GQA models), "both" (backward too; about U = 2P's memory) or "none"."""


@dataclass
class JobConfig:
    upipe: UPipe = field(default_factory=UPipe)


def upipe_config(job_config) -> UPipe:
    """The job's [upipe] section, or the defaults when the custom config module is not loaded."""
    return getattr(job_config, "upipe", None) or UPipe()

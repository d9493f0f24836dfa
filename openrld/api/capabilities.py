"""What this build of openrld can do, stated without importing torch.

This module owns the torch-free facts that discovery publishes: the loss
names the trainer accepts (mirroring `gpu/losses.LOSSES`, which imports
torch and so cannot be read by `api/`; a test keeps the two equal), the
trainer and sampler backends with whether each is built, the Tinker SDK
releases the wire protocol serves, and `ServerInfo`, the body of
`GET /openrl/v1/info`. It guarantees that `server_info` derives every value
from its arguments or from the single definitions it names (settings schema,
NodeConfig, the settings module's "is it built" rule). It does no I/O, keeps
no state, and never imports torch, trio or the HTTP framework.
"""

from __future__ import annotations

import msgspec

from openrld import __version__, sdk_support
from openrld.errors import NotSupportedYet
from openrld.model_catalog import ModelSource
from openrld.progress import Progress
from openrld.settings import JobSettings, require_supported, settings_json_schema

# The newest SDK release whose HTTP protocol openrld serves; older ones down to
# sdk_support.OLDEST_SERVED are served too (sdk_support.TESTED_RELEASES).
TINKER_SDK_VERSION = sdk_support.NEWEST_TESTED

# Names in gpu/losses.LOSSES, in its order; tests/test_capabilities.py checks they agree.
SUPPORTED_LOSSES: tuple[str, ...] = (
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce",
)

# Tinker loss names that the trainer refuses with a reason (gpu/losses.NOT_SUPPORTED).
REFUSED_LOSSES: tuple[str, ...] = ("custom",)

# The trainer_backend values a client may name; "image" stands for any container image reference.
_TRAINER_BACKENDS: tuple[tuple[str, str, str], ...] = (
    ("pytorch", "pytorch", "PyTorch with many LoRA adapters on one resident base model"),
    ("automodel", "automodel", "NeMo Automodel (FSDP2) for multi-GPU trainers"),
    (
        "image", "registry.example/trainer:tag",
        "a custom trainer container image (a reference containing '/'), from the node's [workers] allowed_images",
    ),
)

# Sampler engines, chosen per node by `sampler_backend` in the node config (worker/engines.py).
_SAMPLER_BACKENDS: tuple[tuple[str, bool, str], ...] = (
    ("torch", True, "PyTorch: one prefill per request, batched KV-cached decode"),
    ("vllm", True, "vLLM (sampler_backend = \"vllm\" in the node config; CUDA nodes with the vllm package)"),
)


class Backend(msgspec.Struct, frozen=True):
    name: str
    built: bool  # False: known and validated, refused with "not supported yet" when chosen
    description: str


class Limits(msgspec.Struct, frozen=True):
    """The node's runtime limits, from NodeConfig (reasons: config/openrld.toml)."""

    max_batch_tokens: int
    max_num_samples: int
    max_lora_rank: int
    sample_queue_limit: int
    max_body_bytes: int
    longpoll_s: float


class ModelSummary(msgspec.Struct, frozen=True):
    """One base model this node serves; the same list get_server_capabilities answers."""

    model_name: str
    arch: str
    max_context_length: int  # the longest sequence (prompt + completion) the model takes
    source: ModelSource  # why it is listed: configured, packaged, or served here before
    ready: bool  # False: a GGUF still to be converted (its first use, or the background preparation, does it)
    # Preparing the model's files (a GGUF conversion): its latest progress, final ones
    # included; None when the model never needed preparing.
    preparing: Progress | None = None


class DeviceSummary(msgspec.Struct, frozen=True):
    name: str  # "cpu", "cuda:0"
    kind: str  # "cpu" or "cuda"
    memory_bytes: int


class SdkReleases(msgspec.Struct, frozen=True):
    """The tinker SDK releases a node serves."""

    oldest: str  # the oldest release served
    newest: str  # the newest release tested; newer ones are served as far as they speak the same protocol
    tested: tuple[str, ...]  # every release the test suite runs its loop with, oldest first


class ServerInfo(msgspec.Struct, frozen=True):
    """The body of GET /openrl/v1/info."""

    version: str
    tinker_sdk_version: str  # the newest release served (tinker_sdk_releases.newest)
    tinker_sdk_releases: SdkReleases
    auth: str  # "open" (no key file, loopback only) or "keys"
    limits: Limits
    settings_schema: dict[str, object]
    losses: tuple[str, ...]
    refused_losses: tuple[str, ...]
    trainer_backends: tuple[Backend, ...]
    sampler_backends: tuple[Backend, ...]
    models: tuple[ModelSummary, ...]
    devices: tuple[DeviceSummary, ...]


def _trainer_backend_is_built(example: str) -> bool:
    # The settings module is the one place that says what is built; ask it rather than repeat it.
    try:
        require_supported(JobSettings(trainer_backend=example))
    except NotSupportedYet:
        return False
    return True


def trainer_backends(*, has_automodel: bool = False) -> tuple[Backend, ...]:
    """Each trainer backend, built where the code has it and, for automodel, where this node has
    its environment ([workers] automodel_python): a job naming it elsewhere is refused."""
    return tuple(
        Backend(name, _trainer_backend_is_built(example) and (name != "automodel" or has_automodel), text)
        for name, example, text in _TRAINER_BACKENDS
    )


def sampler_backends() -> tuple[Backend, ...]:
    return tuple(Backend(name, built, text) for name, built, text in _SAMPLER_BACKENDS)


def server_info(
    *, limits: Limits, models: tuple[ModelSummary, ...], devices: tuple[DeviceSummary, ...], is_open_mode: bool,
    has_automodel: bool = False,
) -> ServerInfo:
    """Everything discovery publishes about this node.

    Args:
        limits: from the node config.
        models: the models this node serves without a download (the catalog's listing).
        devices: the compute devices the daemon resolved at startup.
        is_open_mode: True when the node runs without a key file.
        has_automodel: the node has an Automodel environment ([workers] automodel_python).
    """
    return ServerInfo(
        version=__version__,
        tinker_sdk_version=TINKER_SDK_VERSION,
        tinker_sdk_releases=SdkReleases(
            sdk_support.OLDEST_SERVED, sdk_support.NEWEST_TESTED, sdk_support.TESTED_RELEASES
        ),
        auth="open" if is_open_mode else "keys",
        limits=limits,
        settings_schema=settings_json_schema(),
        losses=SUPPORTED_LOSSES,
        refused_losses=REFUSED_LOSSES,
        trainer_backends=trainer_backends(has_automodel=has_automodel),
        sampler_backends=sampler_backends(),
        models=models,
        devices=devices,
    )

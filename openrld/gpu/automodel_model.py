"""Loading a model through NeMo Automodel's FSDP2 path, and writing its LoRA in HF-PEFT form.

`load_sharded` builds one rank's part of the model with
`NeMoAutoModelForCausalLM.from_pretrained`: a `DistributedSetup` of FSDP2 over
`ParallelismSizes(dp_size, cp_size)`, an fp32-reducing `MixedPrecisionPolicy` in the
compute dtype, Hugging Face's own modelling code (`force_hf`, so the forward is the one
the single-device trainers and samplers run), and, for a LoRA job, Automodel's
`PeftConfig` on the modules the job's `LoraSpec` names. It then makes the model fit
openrld's training:
- eval mode (no dropout);
- every FSDP unit sums the ranks' gradients (divide factor 1, as a plain SUM, which gloo
  also has): every loss is a sum over datums, so the sum is the one-process gradient;
- LoRA A drawn whole from a generator seeded with the spec's seed (one broadcast from
  rank 0 when it has none), each rank keeping its rows; B = 0. A DTensor's own random init
  on a CPU mesh gives every shard the same numbers, and this makes N ranks start where
  one does.
- with cp > 1, attention through block-diagonal context parallelism
  (`automodel_cp.use_cp_attention`), and the mesh's cp axis returned for the passes.
`export_peft` writes the adapter with Automodel's `Checkpointer`.

The trainable tensors are keyed as the single-device trainers key them: peft's state-dict
keys for LoRA ("base_model.model." + the model's name), the model's names for full.

What it does not do: train, or import nemo_automodel before it is called (the daemon's
environment does not have it).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from openrld.batches import LoraSpec
from openrld.errors import BadRequest, NotSupportedYet
from openrld.gpu import checkpoint
from openrld.gpu.automodel_cp import use_cp_attention
from openrld.gpu.automodel_shards import local_view, shard_of
from openrld.gpu.automodel_shims import on_device
from openrld.gpu.models import ATTN_MODULES, MLP_MODULES
from openrld.gpu.peft_export import PEFT_CONFIG, PEFT_WEIGHTS

__all__ = ["ShardSizes", "export_peft", "load_sharded"]

PEFT_PREFIX = "base_model.model."  # peft's state-dict keys are the model's names under this
LORA_ALPHA = 32  # as models.lora_config: alpha 32 whatever the rank (Tinker's)
EXPORT_STAGING = ".automodel-export"  # inside the export's directory: the Checkpointer writes there first


class ShardSizes(msgspec.Struct, frozen=True):
    dp: int  # data-parallel ranks: FSDP shards over them, and the datums are split over them
    cp: int = 1  # context-parallel ranks per data-parallel rank


def load_sharded(
    model_dir: str, device: torch.device, dtype: torch.dtype, sizes: ShardSizes, spec: LoraSpec | None
) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter], object | None, DeviceMesh | None]:
    """This rank's part of the model, ready to train.

    Returns:
        (the FSDP2 root module, the trainable tensors by key, Automodel's PeftConfig or None,
        the cp group's DeviceMesh when sizes.cp > 1, else None).
    Raises:
        NotSupportedYet: NeMo Automodel is not installed here.  BadRequest: a LoRA that trains nothing.
    """
    try:
        from nemo_automodel import NeMoAutoModelForCausalLM
        from nemo_automodel.components._peft.lora import PeftConfig
        from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
        from nemo_automodel.components.distributed.mesh import ParallelismSizes
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    except ImportError as error:
        raise NotSupportedYet(
            f"the automodel trainer needs NeMo Automodel in its worker's environment (`make automodel-env`): {error}"
        ) from error

    strategy = FSDP2Config(mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    setup = DistributedSetup.build(strategy=strategy, parallelism_sizes=ParallelismSizes(dp_size=sizes.dp, cp_size=sizes.cp))
    peft_config = None
    if spec is not None:
        peft_config = PeftConfig(
            target_modules=lora_targets(spec), dim=spec.rank, alpha=LORA_ALPHA, dropout=0.0, lora_A_init="kaiming"
        )
    with on_device(device):
        model = NeMoAutoModelForCausalLM.from_pretrained(
            model_dir, distributed_setup=setup, peft_config=peft_config, force_hf=True, dtype=dtype,
            use_liger_kernel=False, use_sdpa_patching=False, attn_implementation="sdpa",
        )
    model.eval()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    cp_mesh = None
    if sizes.cp > 1:
        use_cp_attention(model, device)
        cp_mesh = setup.mesh_context.device_mesh["cp"]
    if spec is None:
        return model, dict(model.named_parameters()), None, cp_mesh
    params = {PEFT_PREFIX + key: p for key, p in model.named_parameters() if ".lora_A." in key or ".lora_B." in key}
    assert params, "Automodel put no LoRA tensors in the model"
    seeded_lora_init(params, spec.seed)
    return model, params, peft_config, cp_mesh


def lora_targets(spec: LoraSpec) -> list[str]:
    """Automodel's module patterns for the modules `models.lora_target_modules` names."""
    targets: list[str] = []
    if spec.train_attn:
        targets += [f"*.{m}" for m in ATTN_MODULES]
    if spec.train_mlp:
        targets += [f"*.{m}" for m in MLP_MODULES]
    if spec.train_unembed:
        targets.append("lm_head")
    if not targets:
        raise BadRequest("a LoRA must train at least one of attn, mlp, unembed", key="lora_config")
    return targets


def seeded_lora_init(params: dict[str, torch.nn.Parameter], seed: int | None) -> None:
    """A = kaiming_uniform(a=√5) drawn whole, in key order, from one seeded generator; B = 0.

    Every rank draws the same whole tensors and keeps its own rows, so the init does not
    depend on how many ranks there are. Without a seed, rank 0's random one is broadcast.
    """
    if seed is None:
        shared = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        dist.broadcast(shared, src=0)
        seed = int(shared)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key in sorted(params):
            param = params[key]
            full = torch.zeros(tuple(param.shape), dtype=torch.float32)
            if ".lora_A." in key:
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            local_view(param).copy_(shard_of(full, param).to(param.dtype))


def export_peft(model: torch.nn.Module, peft_config: object, directory: Path, base_model: str, dp_rank: int) -> int:
    """Write the LoRA with Automodel's `Checkpointer` (every rank calls; rank 0 writes) as exactly
    `adapter_model.safetensors` and `adapter_config.json` (naming `base_model`) in the empty
    `directory`, each fsynced. Returns the bytes written (0 off rank 0)."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    staging = directory / EXPORT_STAGING
    config = CheckpointingConfig(
        enabled=True, checkpoint_dir=str(staging), model_save_format="safetensors", model_repo_id=base_model,
        save_consolidated=False, is_peft=True,
    )
    checkpointer = Checkpointer(config, dp_rank=dp_rank, tp_rank=0, pp_rank=0, moe_mesh=None)
    checkpointer.save_model(model, str(staging), peft_config=peft_config)
    if dist.get_rank() != 0:
        return 0
    written = staging / "model"  # save_model's layout: <path>/model/<the peft files>
    size = 0
    for filename in (PEFT_WEIGHTS, PEFT_CONFIG):
        data = (written / filename).read_bytes()
        if filename == PEFT_CONFIG:  # the base model as the caller names it, not this node's path
            body = {**json.loads(data), "base_model_name_or_path": base_model}
            data = json.dumps(body, indent=2, sort_keys=True).encode()
        size += checkpoint.write_synced(directory / filename, data)
    shutil.rmtree(staging)
    checkpoint.fsync_directory(directory)
    return size

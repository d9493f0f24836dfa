"""Run in the Automodel environment by test_automodel_families.py: for each tiny family given,
the Automodel trainer (one rank, gloo on the CPU) takes 3 SFT steps of LoRA and of full
fine-tuning in this one process; prints one JSON line per (family, fine_tuning):
{"family", "fine_tuning", "losses" | "error", "lora_modules"}. Its imports (~20 s) are paid once."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.gpu.automodel_trainer import AutomodelOptions, AutomodelTrainer

TOKENS = np.array([(5 + 7 * i + (i * i) % 13) % 380 + 3 for i in range(40)], np.int64)
BATCH = ForwardBackwardBatch(
    data=[TrainDatum(tokens=TOKENS[:-1], inputs={"target_tokens": TOKENS[1:], "weights": np.ones(39, np.float32)})],
    loss_fn="cross_entropy", loss_config={}, forward_only=False,
)
LEARNING_RATE = {"lora": 5e-3, "full": 1e-3}


def run(model_dir: Path, fine_tuning: str) -> dict:
    trainer = AutomodelTrainer(model_dir, torch.device("cpu"), AutomodelOptions(fine_tuning=fine_tuning))
    trainer.add_adapter("job", LoraSpec(rank=4, seed=1) if fine_tuning == "lora" else None, "adamw")
    losses = []
    for _ in range(3):
        losses.append(trainer.forward_backward("job", BATCH).metrics["loss:sum"])
        trainer.optim_step("job", AdamParams(learning_rate=LEARNING_RATE[fine_tuning]))
    # The module each LoRA tensor adapts (its name's part before lora_A / lora_B).
    modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in trainer._params}) if fine_tuning == "lora" else []
    trainer.close()
    return {"losses": losses, "lora_modules": modules}


def main() -> None:
    root = Path(sys.argv[1])
    for family in sys.argv[2:]:
        for fine_tuning in ("lora", "full"):
            try:
                result = run(root / family, fine_tuning)
            except Exception as error:  # reported per family, so one family's failure names itself
                result = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps({"family": family, "fine_tuning": fine_tuning, **result}), flush=True)


if __name__ == "__main__":
    main()

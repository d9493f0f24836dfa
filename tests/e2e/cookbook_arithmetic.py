"""tinker-cookbook's RL loop on math_rl's arithmetic environment, unmodified, run offline.

    python tests/e2e/cookbook_arithmetic.py URL MODEL TOKENIZER_DIR LOG_DIR STEPS

This is what `tinker_cookbook.recipes.math_rl.train` builds for `env=arithmetic`
(`ArithmeticDatasetBuilder` with the few-shot prefix, and `tinker_cookbook.rl.train.main`),
made small for the tiny test model: 2 groups of 4 a step, 4 tokens a reply, LoRA rank 4, the
`role_colon` renderer (the tiny tokenizer has no chat template), and the loop's default loss
(`importance_sampling`). The recipe's own module is not imported: it imports its math
environment too, whose grading needs packages this project does not install.

What the cookbook needs to run offline comes first, as recipes/cookbook_offline.py does it:
the model's local tokenizer registered under the model's name (the cookbook loads a
tokenizer by its Hugging Face name), and TINKER_API_KEY (the tests' key).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `recipes`

from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train

from recipes.cookbook_offline import prepare_cookbook

API_KEY = "tml-test"
RENDERER = "role_colon"


def main(argv: list[str]) -> int:
    url, model, tokenizer_dir, log_dir, steps = argv
    prepare_cookbook(model, tokenizer_dir, API_KEY)
    config = train.Config(
        learning_rate=1e-2, model_name=model, recipe_name="recipe_math_rl", renderer_name=RENDERER,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=2, model_name_for_tokenizer=model, renderer_name=RENDERER, n_batches=100, group_size=4,
        ),
        lora_rank=4, max_tokens=4, log_path=log_dir, base_url=url, eval_every=0, save_every=0,
        max_steps=int(steps),
    )
    asyncio.run(train.main(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

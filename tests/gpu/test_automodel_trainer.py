"""The Automodel trainer (gpu/automodel_trainer.py) as the daemon drives it: a torchrun group of
2 CPU ranks (gloo) in the Automodel environment behind one worker endpoint, through
`RemoteTrainer` and the real worker protocol.

What is checked, against a one-process run of the single-device trainers (TorchTrainer for
LoRA, FullTrainer for full fine-tuning) in the same environment, from the same start:
- parity: over 5 steps of forward_backward_then_step with every built-in loss in each step
  (7 requests, 3 datums each, micro-batches small enough that both ranks score datums),
  the losses, metrics, log-probabilities and final weights agree within 1e-5;
- full fine-tuning's group checkpoints the layers of its larger rounds and still trains as
  one process;
- resume: a state saved at step 3 (with optimizer) and loaded into a fresh group continues
  to the same weights as the uninterrupted group, though the fresh group checkpoints the
  layers of its rounds over its activation budget (6 of 10) and the first group none;
- activation checkpointing is chosen per round: both ranks checkpoint the same rounds, those
  whose largest micro-batch passes the budget, even where a rank's own one does not;
- sampling: the exported adapter loads in peft, whose log-probabilities match the group's
  forward; full fine-tuning's deltas, loaded by openrld's full sampler (which checks their
  digest), give it the group's weights bit for bit;
- Dimuon (LoRA) over whole matrices on 2 ranks as in one process;
- full fine-tuning's state and sampler files, streamed from the shards one tensor at a time,
  are the one-process FullTrainer's byte for byte;
- refusals: a second job, Dimuon params to an AdamW job, a cp that does not divide the group.

The Automodel environment is `.venv-automodel` at the repository root (`make automodel-env`);
without it every test here is skipped. Each group start costs ~20 s of imports on 2 cores, so
the tests share groups by module-scoped fixtures, and run in file order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from openrld.batches import AdamParams, DimuonParams, ForwardBackwardBatch, LoraSpec, TrainDatum
from openrld.errors import BadRequest, Conflict
from openrld.gpu.automodel_passes import round_tokens, rounds_over_budget
from openrld.gpu.scoring import plan_micro_batches
from openrld.worker.client import RemoteTrainer, WorkerTimeouts
from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
from openrld.worker.launchers.process import ProcessLauncher
from openrld.worker.launchers.torchrun import TorchrunLauncher
from openrld.worker.protocol import Start
from openrld.worker.values import local_payload

REPO = Path(__file__).resolve().parents[2]
SAVE_REPORTING_WORKER = Path(__file__).with_name("automodel_save_worker.py")
AUTOMODEL_PYTHON = REPO / ".venv-automodel" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not AUTOMODEL_PYTHON.exists(),
    reason=".venv-automodel is not built (make automodel-env): the Automodel trainer runs only in its own environment",
)

TIMEOUTS = WorkerTimeouts(hello_s=180.0, heartbeat_s=1.0, deadline_s=180.0, stop_s=20.0)
MAX_BATCH_TOKENS = 24  # datums of 5-12 tokens: several micro-batches per request, so both ranks score
STEPS = 5
SAVE_AT = 3
POISONED_AT = 1
ATOL = 1e-5  # fp32 over 5 AdamW steps; the ranks only change the order of the gradient sums
ADAM = AdamParams(learning_rate=5e-3, grad_clip_norm=5.0)
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
SPEC = LoraSpec(rank=4, seed=7)
# Activations a round may keep before its layers are checkpointed: the tiny Llama keeps 8,372 bytes
# a padded token here (measured: statistics().activation_bytes_per_token), so rounds of 21 tokens
# and more checkpoint and rounds of 20 and fewer run plain (8,372 x 20.5 = 171,626).
CHECKPOINT_BUDGET = 171_626


def step_batches(step: int) -> list[ForwardBackwardBatch]:
    """One request per built-in loss, 3 datums each, seeded by the step."""
    rng = np.random.default_rng(100 + step)
    batches = []
    for loss in LOSSES:
        data = []
        for _ in range(3):
            n = int(rng.integers(5, 13))
            inputs = {"target_tokens": rng.integers(0, 384, n)}
            recorded = None
            if loss == "cross_entropy":
                inputs["weights"] = (rng.random(n) > 0.2).astype(np.float32)
            else:
                inputs["advantages"] = (rng.normal(size=n) * (rng.random(n) > 0.3)).astype(np.float32)
                inputs["logprobs"] = (-5.95 + 0.1 * rng.normal(size=n)).astype(np.float32)
            if loss == "gspo":
                inputs["sequence_ratio_mask"] = (rng.random(n) > 0.2).astype(np.float32)
            if loss == "stable_reinforce":
                recorded = np.where(rng.random(n) > 0.3, inputs["logprobs"], np.nan).astype(np.float32)
            data.append(TrainDatum(tokens=rng.integers(0, 384, n), inputs=inputs, recorded_logprobs=recorded))
        batches.append(ForwardBackwardBatch(data=data, loss_fn=loss, loss_config={}, forward_only=False))
    return batches


def start(directory: Path, start: Start, ranks: int) -> RemoteTrainer:
    launcher = TorchrunLauncher(str(AUTOMODEL_PYTHON), ranks) if ranks > 1 else ProcessLauncher(str(AUTOMODEL_PYTHON))
    connection, _ = start_worker(launcher, WorkerSpec(name=start.kind, role="trainer", start=start), directory, timeouts=TIMEOUTS)
    return RemoteTrainer(connection)


def group(directory: Path, model: Path, fine_tuning: str, activation_budget_bytes: int = 0) -> RemoteTrainer:
    options = {
        "fine_tuning": fine_tuning, "max_batch_tokens": MAX_BATCH_TOKENS, "weight_sync": "delta",
        "activation_budget_bytes": activation_budget_bytes,
    }
    return start(directory, Start("automodel_trainer", str(model), "cpu", threads=1, options=options), 2)


def single(directory: Path, model: Path, kind: str) -> RemoteTrainer:
    return start(directory, Start(kind, str(model), "cpu", threads=2, options={"max_batch_tokens": MAX_BATCH_TOKENS}), 1)


def poisoned() -> ForwardBackwardBatch:
    """A request whose loss is inf on rank 1 alone: datums of 12, 12 and 5 tokens plan as [12, 12]
    (rank 0) and [5] (rank 1), and the 5-token datum's ratio is exp(lp + 1000)."""
    data = []
    for n, sampled in ((12, -5.95), (12, -5.95), (5, -1000.0)):
        inputs = {
            "target_tokens": np.arange(n) + 1, "advantages": np.ones(n, np.float32),
            "logprobs": np.full(n, sampled, np.float32),
        }
        data.append(TrainDatum(tokens=np.arange(n) + 20, inputs=inputs))
    return ForwardBackwardBatch(data=data, loss_fn="importance_sampling", loss_config={}, forward_only=False)


def train(
    trainer: RemoteTrainer, steps: range, save_to: Path | None = None, refusals: list[str] | None = None,
    params: AdamParams | DimuonParams = ADAM,
) -> list[list]:
    """The results of `steps`; with `save_to`, the state (with optimizer) after step SAVE_AT.

    At step POISONED_AT the pass and the step are two calls, with a request whose loss is not
    finite between them: it must add nothing, so the run goes on as if it had not been sent.
    """
    results, refusals = [], [] if refusals is None else refusals
    for step in steps:
        if step == POISONED_AT:
            passes = trainer.forward_backward_many("job", step_batches(step))
            with pytest.raises(BadRequest, match=r"loss for 'importance_sampling' is not finite \(-inf\)") as refused:
                trainer.forward_backward("job", poisoned())
            refusals.append(str(refused.value))
            stepped = trainer.optim_step("job", params)
        else:
            passes, stepped = trainer.forward_backward_then_step("job", step_batches(step), params)
        assert not isinstance(stepped, Exception), stepped
        results.append([passes, stepped])
        if save_to is not None and step + 1 == SAVE_AT:
            save_to.mkdir()
            trainer.save_state("job", save_to, True)
    return results


def assert_runs_agree(ours: list[list], theirs: list[list]) -> str:
    """Every log-probability within ATOL, every metric (sums of ~100) within ATOL relative;
    returns the largest differences seen, for the log."""
    worst_lp = worst_metric = 0.0
    for (passes, stepped), (their_passes, their_stepped) in zip(ours, theirs, strict=True):
        for mine, reference in zip(passes, their_passes, strict=True):
            assert mine.metrics.keys() == reference.metrics.keys()
            for key, value in mine.metrics.items():
                worst_metric = max(worst_metric, abs(value - reference.metrics[key]) / max(1.0, abs(value)))
                assert value == pytest.approx(reference.metrics[key], abs=ATOL, rel=ATOL), key
            for lp, their_lp in zip(mine.logprobs, reference.logprobs, strict=True):
                assert lp.shape == their_lp.shape
                worst_lp = max(worst_lp, float(np.abs(lp - their_lp).max()))
                np.testing.assert_allclose(lp, their_lp, atol=ATOL, rtol=0)
        assert stepped.metrics["grad_norm:mean"] == pytest.approx(their_stepped.metrics["grad_norm:mean"], rel=ATOL)
    return f"logprobs {worst_lp:.2e}, metrics {worst_metric:.2e} relative"


def max_weight_difference(ours, theirs) -> float:
    ours, theirs = local_payload(ours), local_payload(theirs)
    assert ours.keys() == theirs.keys()
    return max(float((ours[key] - theirs[key]).abs().max()) for key in ours)


@pytest.fixture(scope="module")
def sockets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return socket_directory(tmp_path_factory.mktemp("sockets"))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, sockets, tiny_llama):
    """The one-process LoRA run (TorchTrainer) and the 2-rank group's, from the same start."""
    root = tmp_path_factory.mktemp("lora")
    reference = single(sockets, tiny_llama, "lora_trainer")
    reference.add_adapter("job", SPEC, "adamw")
    (root / "start").mkdir()
    reference.save_state("job", root / "start", False)
    theirs = train(reference, range(STEPS))
    their_weights = reference.adapter_tensors("job")
    reference.close()
    alone = start(sockets, Start("automodel_trainer", str(tiny_llama), "cpu", threads=2, options={"fine_tuning": "lora"}), 1)
    alone.add_adapter("init", SPEC, "adamw")
    init_alone = local_payload(alone.adapter_tensors("init"))
    alone.close()
    trainer = group(sockets, tiny_llama, "lora")
    trainer.add_adapter("init", SPEC, "adamw")
    init_group = local_payload(trainer.adapter_tensors("init"))
    trainer.drop_adapter("init")
    trainer.load_state("job", root / "start", SPEC, False, "adamw")
    refusals: list[str] = []
    ours = train(trainer, range(STEPS), save_to=root / "step3", refusals=refusals)
    our_weights = local_payload(trainer.adapter_tensors("job"))
    yield trainer, root, ours, (theirs, their_weights, our_weights), (init_alone, init_group), refusals
    trainer.close()


def test_two_ranks_train_lora_as_one_process_does_with_every_loss(lora_run):
    trainer, _, ours, (theirs, their_weights, _), _, refusals = lora_run
    worst = assert_runs_agree(ours, theirs)
    # The poisoned request failed on rank 1 alone, and added nothing on either rank.
    assert refusals and refusals[0].startswith("rank 1 of 2 failed: loss for 'importance_sampling'"), refusals
    weights = trainer.adapter_tensors("job")
    difference = max_weight_difference(weights, their_weights)
    print(f"lora parity: largest differences: {worst}, weights {difference:.2e}")
    assert difference <= ATOL


def test_a_seeded_lora_starts_the_same_on_two_ranks_as_on_one(lora_run):
    init_alone, init_group = lora_run[4]
    assert init_alone.keys() == init_group.keys()
    assert all(torch.equal(init_alone[key], init_group[key]) for key in init_alone)
    assert any(float(t.abs().sum()) > 0 for key, t in init_group.items() if "lora_A" in key)


def test_a_second_job_and_dimuon_are_refused_by_name(lora_run):
    trainer = lora_run[0]
    with pytest.raises(Conflict, match="it serves one job"):
        trainer.add_adapter("other", SPEC, "adamw")
    with pytest.raises(BadRequest, match="optimizer mismatch"):
        trainer.optim_step("job", DimuonParams(learning_rate=1e-3))


def test_the_exported_adapter_gives_peft_the_groups_logprobs(lora_run, tiny_llama, tmp_path):
    import peft
    import transformers

    trainer = lora_run[0]
    export = tmp_path / "export"
    export.mkdir()
    trainer.export_adapter("job", export, str(tiny_llama))
    from safetensors.torch import load_file

    assert sorted(p.name for p in export.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((export / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (SPEC.rank, 32, str(tiny_llama))
    exported, trained = load_file(str(export / "adapter_model.safetensors")), local_payload(trainer.adapter_tensors("job"))
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    datum = step_batches(0)[0].data[0]
    scored = trainer.forward_backward(
        "job", ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=True)
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(export)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(datum.tokens)[None]).logits[0].float()
    lp = torch.log_softmax(logits, -1)[torch.arange(len(datum.tokens)), torch.from_numpy(datum.inputs["target_tokens"])]
    difference = float(np.abs(lp.numpy() - scored.logprobs[0]).max())
    print(f"peft export: largest logprob difference {difference:.2e}")
    assert difference <= 1e-5


def test_dimuon_over_whole_matrices_steps_two_ranks_as_one_process(lora_run, sockets, tiny_llama):
    trainer, root = lora_run[0], lora_run[1]
    dimuon = DimuonParams(learning_rate=2e-3, grad_clip_norm=5.0)
    reference = single(sockets, tiny_llama, "lora_trainer")
    reference.load_state("job", root / "start", SPEC, False, "dimuon")
    theirs = train(reference, range(3), params=dimuon)
    their_weights = reference.adapter_tensors("job")
    reference.close()
    trainer.drop_adapter("job")
    trainer.load_state("job", root / "start", SPEC, False, "dimuon")
    ours = train(trainer, range(3), params=dimuon)
    worst = assert_runs_agree(ours, theirs)
    difference = max_weight_difference(trainer.adapter_tensors("job"), their_weights)
    print(f"dimuon parity: largest differences: {worst}, weights {difference:.2e}")
    assert difference <= ATOL


@pytest.fixture(scope="module")
def checkpointed_resume(lora_run, sockets, tiny_llama):
    """A fresh group whose rounds over CHECKPOINT_BUDGET checkpoint their layers, resuming the
    LoRA group's run (which checkpointed none) from its step-3 state: its results, its weights,
    and each rank's statistics after (the reporting worker writes them beside a save)."""
    trainer, root = lora_run[0], lora_run[1]
    trainer.close()  # two groups do not fit two cores at once
    options = {
        "fine_tuning": "lora", "max_batch_tokens": MAX_BATCH_TOKENS, "weight_sync": "delta",
        "activation_budget_bytes": CHECKPOINT_BUDGET,
    }
    engine_start = Start("automodel_trainer", str(tiny_llama), "cpu", threads=1, options=options)
    spec = WorkerSpec(name="automodel_trainer", role="trainer", start=engine_start)
    launcher = TorchrunLauncher(str(AUTOMODEL_PYTHON), 2, (str(SAVE_REPORTING_WORKER),))
    fresh = RemoteTrainer(start_worker(launcher, spec, sockets, timeouts=TIMEOUTS)[0])
    try:
        fresh.load_state("job", root / "step3", SPEC, True, "adamw")
        resumed = train(fresh, range(SAVE_AT, STEPS))
        weights = local_payload(fresh.adapter_tensors("job"))
        (root / "resumed").mkdir()
        fresh.save_state("job", root / "resumed", False)
    finally:
        fresh.close()
    statistics = [json.loads((root / f"resumed.rank{rank}.statistics.json").read_text()) for rank in range(2)]
    return resumed, weights, statistics


def test_a_state_loaded_into_a_fresh_group_resumes_the_run_its_layers_checkpointed_or_not(lora_run, checkpointed_resume):
    ours, weights = lora_run[2], lora_run[3][2]
    resumed, resumed_weights, _ = checkpointed_resume
    worst = assert_runs_agree(resumed, ours[SAVE_AT:])
    difference = max_weight_difference(resumed_weights, weights)
    print(f"resumed, checkpointed: largest differences: {worst}, weights {difference:.2e}")
    assert difference <= 1e-6


def test_both_ranks_checkpoint_the_rounds_whose_largest_micro_batch_passes_the_budget(checkpointed_resume):
    statistics = checkpointed_resume[2]
    per_token = statistics[0]["activation_bytes_per_token"]
    # Every rank plans the same micro-batches (longest first) and runs them two a round.
    sizes = []
    for step in range(SAVE_AT, STEPS):
        lengths = [len(datum.tokens) for batch in step_batches(step) for datum in batch.data]
        sizes.append(round_tokens(plan_micro_batches(lengths, MAX_BATCH_TOKENS), lengths, dp_size=2, cp=1))
    expected = sum(sum(rounds_over_budget(step_sizes, per_token, CHECKPOINT_BUDGET)) for step_sizes in sizes)
    rounds = sum(len(step_sizes) for step_sizes in sizes)
    print(f"activations: {per_token:.0f} bytes a token; {expected} of {rounds} rounds over {CHECKPOINT_BUDGET} bytes")
    # Rounds of 24, 22, 20, 24, 15 tokens at step 3 and 24, 20, 18, 24, 21 at step 4: six pass 20.5.
    # At step 3 the round of 22 pairs micro-batches of 22 and 20: rank 1's own is under the budget.
    assert (expected, rounds) == (6, 10)
    assert [(s["backward_rounds"], s["checkpointed_rounds"]) for s in statistics] == [(rounds, expected)] * 2
    assert statistics[1]["activation_bytes_per_token"] == per_token


def test_two_ranks_train_every_weight_as_one_process_does_sync_it_by_delta_and_resume(sockets, tiny_llama, tmp_path):
    from openrld.gpu.full_sampler import FullSampler

    reference = single(sockets, tiny_llama, "full_trainer")
    reference.add_adapter("job", None, "adamw")
    theirs = train(reference, range(STEPS))
    their_weights = reference.adapter_tensors("job")
    reference.close()
    # Full fine-tuning keeps 9,660 bytes a token: rounds of 18 tokens and more checkpoint, the rest run plain.
    trainer = group(sockets, tiny_llama, "full", activation_budget_bytes=CHECKPOINT_BUDGET)
    try:
        trainer.add_adapter("job", None, "adamw")
        # The job's sampler: openrld's full sampler, which patches each delta in place and checks
        # the digest of its weights against the trainer's (WeightMismatch otherwise).
        sampler = FullSampler(tiny_llama, torch.device("cpu"))
        first = train(trainer, range(2))
        sampler.load_version("v1", local_payload(trainer.sampler_payload("job", "v1")), None)
        ours = first + train(trainer, range(2, STEPS), save_to=tmp_path / "step3")
        change = local_payload(trainer.sampler_payload("job", "v2"))
        assert change.base_version == "v1" and change.mode == "delta" and change.changed_elements > 0
        sampler.load_version("v2", change, None)
        weights = local_payload(trainer.adapter_tensors("job"))
        worst = assert_runs_agree(ours, theirs)
        difference = max_weight_difference(weights, their_weights)
        print(f"full parity: largest differences: {worst}, weights {difference:.2e}")
        assert difference <= ATOL
        held = sampler.live_weights()
        assert held.keys() == weights.keys()
        assert all(torch.equal(held[key], weights[key]) for key in weights), "the sampler's weights differ"
        # Resume: the state saved at step 3 (whole weights and AdamW moments, from the shards)
        # takes the group back there, and the last two steps come out the same.
        trainer.load_state("job", tmp_path / "step3", None, True, "adamw")
        resumed = train(trainer, range(SAVE_AT, STEPS))
        assert_runs_agree(resumed, ours[SAVE_AT:])
        assert max_weight_difference(trainer.adapter_tensors("job"), weights) <= 1e-6
    finally:
        trainer.close()


def test_full_state_is_streamed_from_the_shards_as_one_process_writes_it(sockets, tiny_llama, tmp_path):
    """The one-process FullTrainer's state (after a step: weights and AdamW moments), loaded into
    the group and saved again there, is the same files byte for byte: a load keeps each rank's
    rows exactly and the gathers put them back together, so any difference would be the streamed
    writer's. The worker (automodel_save_worker.py) leaves each rank's statistics beside each save."""
    reference = single(sockets, tiny_llama, "full_trainer")
    reference.add_adapter("job", None, "adamw")
    train(reference, range(1))
    for kind in ("state", "sampler"):
        (tmp_path / f"reference-{kind}").mkdir()
    reference.save_state("job", tmp_path / "reference-state", True)
    reference.sampler_checkpoint("job", tmp_path / "reference-sampler")
    reference.close()
    options = {"fine_tuning": "full", "max_batch_tokens": MAX_BATCH_TOKENS, "weight_sync": "delta"}
    engine_start = Start("automodel_trainer", str(tiny_llama), "cpu", threads=1, options=options)
    spec = WorkerSpec(name="automodel_trainer", role="trainer", start=engine_start)
    launcher = TorchrunLauncher(str(AUTOMODEL_PYTHON), 2, (str(SAVE_REPORTING_WORKER),))
    trainer = RemoteTrainer(start_worker(launcher, spec, sockets, timeouts=TIMEOUTS)[0])
    try:
        trainer.load_state("job", tmp_path / "reference-state", None, True, "adamw")
        for kind in ("state", "sampler"):
            (tmp_path / f"streamed-{kind}").mkdir()
        sizes = {
            "state": trainer.save_state("job", tmp_path / "streamed-state", True),
            "sampler": trainer.sampler_checkpoint("job", tmp_path / "streamed-sampler"),
        }
    finally:
        trainer.close()
    for kind, files in (("state", ["full_model.json", "model.safetensors", "optimizer.safetensors", "state.json"]),
                        ("sampler", ["full_model.json", "model.safetensors"])):
        ours, theirs = tmp_path / f"streamed-{kind}", tmp_path / f"reference-{kind}"
        assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir()) == files
        for name in files:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), f"{kind}: {name} differs"
        assert sizes[kind] == sum((ours / name).stat().st_size for name in files)
        saved = json.loads((tmp_path / f"streamed-{kind}.rank0.statistics.json").read_text())["last_save"]
        streamed = [name for name in files if name.endswith(".safetensors")]
        assert [file["file"] for file in saved] == streamed
        for file in saved:
            with safe_open(str(ours / file["file"]), framework="pt") as opened:
                count = len(opened.keys())
            size = (ours / file["file"]).stat().st_size
            # One gathered tensor held at a time on rank 0: each was written and dropped before the next gather.
            assert (file["tensors"], file["bytes"], file["peak_held"]) == (count, size, 1)
    assert len(saved) == 1 and saved[0]["tensors"] > 1


def test_a_cp_that_does_not_divide_a_group_of_one_is_refused_naming_trainer_cp(sockets, tiny_llama):
    # cp > 1 itself runs (tests/gpu/test_automodel_cp.py); a group of one cannot be split in two.
    options = {"fine_tuning": "lora", "cp": 2}
    with pytest.raises(BadRequest, match=r"openrl.trainer_cp=2 does not divide openrl.trainer_gpus=1") as refused:
        start(sockets, Start("automodel_trainer", str(tiny_llama), "cpu", threads=1, options=options), 1)
    assert refused.value.key == "trainer_cp"

"""The device check: every CUDA path of openrld, one line each with its measured figure.

One script, under eight minutes on one H100 or H200, one line per check:
    PASS <check>: <figures>    MEASURE <check>: <figures>    FAIL <check>: <what differed>    SKIP <check>: <why>
PASS means its requirements held; MEASURE is a figure with no requirement (it informs a
decision and cannot fail but by an error); exit status 1 when any check failed. Without CUDA every check SKIPs (so it runs
anywhere, as CI-less proof that it starts); without vLLM the vLLM checks SKIP.

Checks:
- offload.trainer_round_trip: a tiny Llama TorchTrainer on cuda with an adapter, its
  gradients and AdamW moments; park() moves them all to pinned host memory and frees
  the device (device_bytes_freed >= bytes_moved); resume() brings back every tensor
  bit for bit, the same tensor objects, and the device memory it held.
- offload.training_across_park: two adapters with the same seed, one parked and
  resumed between its steps, give identical losses and identical weights.
- offload.sampler_round_trip: a TorchSampler parked and resumed samples the same
  seeded tokens and logprobs as before.
- offload.throughput: park/resume of a ~100M-parameter bf16 model: GB/s each way, at least
  half a bare pinned copy of the same bytes measured in the same run (THROUGHPUT_SHARE).
- sampler.torch_logprobs: the torch sampler on cuda (fp32) reports sampled and prompt
  logprobs equal to the trainer's forward within 1e-3 (issue 4).
- worker.cuda_trainer: a LoRA TorchTrainer on cuda in a process worker (the worker
  protocol) trains as the in-process one does (losses and adapter tensors within 1e-5),
  and its park, measured inside the worker, moved its state off a CUDA device and freed
  that device memory (a worker that fell back to the CPU fails).
- full.trainer_bf16: a FullTrainer on cuda in bf16 keeps fp32 master weights; its losses
  follow the CPU's fp32 run (2e-2 relative: bf16 forward) and its weights are the
  master rounded.
- worker.cuda_full_trainer: the same FullTrainer as a process worker trains bit for bit
  as in process, and its park, measured in the worker, freed memory on a CUDA device.
- delta.sync_10: a FullTrainer (weight_sync=delta) and a FullSampler on one device, ten
  steps each followed by a sync: every sync's digest checks on the sampler, the payload
  is in host memory, the sampler's weights equal the trainer's bit for bit, and device
  memory after the tenth sync is what it was after the first (no payload accumulates).
- timeslicer.two_jobs: two full fine-tuning jobs (~47M parameters) on one device under
  the TimeSlicer actor (a party each): they take turns, the one waiting is parked (the
  tensor memory at each turn is at most 1.5x one job's footprint after its steps:
  weights, delta shadow, AdamW's moments and fp32 master), and each job's losses equal its
  run alone, bit for bit. cuBLAS's per-thread workspaces are left out of every figure and
  the run alone is collected before the jobs start (its park slot is a reference cycle).
- worker.launcher_measurement (MEASURE): two LoRA trainers on one device stepping at once,
  as two threads of one process (one CUDA context, the GIL shared) against two process
  workers (a CUDA context each): steps per second of each, and their ratio. The figure
  the default launcher for GPU nodes is decided from.
- vllm.*: a tiny random Llama (head_dim 64) served by VllmSampler: sampled-token and
  prompt logprobs at T = 1 against the trainer's forward (1e-3 in fp32; 5e-2 if vLLM
  must run it in bf16), T = 0.7 logprobs against log_softmax(logits / 0.7), T = 2.5
  refused as a 400 by openrld, then by vLLM's own SamplingParams and a prompt as long as
  the context by vLLM's input processor with openrld's checks stepped aside (the
  VLLMValidationError mapping), the engine still serving; a seed reproducing its tokens, a
  LoRA version against the trainer's forward with that adapter, a reloaded version under a
  new adapter name, sleep/wake (memory freed, the same seeded tokens after waking), and
  vllm.full_sync: a full fine-tuning job's delta syncs patched into vLLM's weights in place,
  digest-checked, bit for bit the trainer's, one of them made while asleep.

Run on the GPU test machine with bench/gpu_check.sh (it says what it needs), or from the
repository root: `PYTHONPATH=. python3 bench/gpu_check.py [PREFIX ...]`, which runs only the
checks whose names start with a PREFIX (the others SKIP as not selected): on a vLLM node,
`PYTHONPATH=. .venv-vllm/bin/python bench/gpu_check.py vllm` in the environment `make
vllm-env` builds.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, SampleJob, SamplingSpec, TrainDatum
from openrld.errors import BadRequest
from openrld.gpu import offload
from openrld.gpu.tiny_models import build_tiny_model, build_tokenizer
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer

TEXT = "User: what is two plus two? Assistant: four. The quick brown fox jumps over the lazy dog."
SPEC = LoraSpec(rank=8, seed=3)
# Checks that measure a figure with no requirement: a MEASURE line, never a PASS.
MEASUREMENTS = ("worker.launcher_measurement",)
VLLM_CONTEXT = 1024  # the vLLM engines' max_model_len
FP32_TOLERANCE = 1e-3  # issue 4: sampled logprobs at T = 1 match the trainer's forward within 1e-3
BF16_TOLERANCE = 5e-2  # bf16 logits of a random model differ from fp32 by ~1e-2


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def run(self, name: str, check: Callable[[], str], *, measure: bool = False) -> None:
        """One line for `check`: PASS (its requirements held), or MEASURE for a figure that has no
        requirement (it informs a decision); FAIL when it raised, SKIP when it could not run."""
        start = time.perf_counter()
        try:
            detail = check()
        except Skip as skip:
            print(f"SKIP {name}: {skip}", flush=True)
            return
        except Exception as error:
            self.failed += 1
            print(f"FAIL {name}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc(limit=4, file=sys.stdout)
            return
        print(f"{'MEASURE' if measure else 'PASS'} {name}: {detail} ({time.perf_counter() - start:.1f} s)", flush=True)


class Skip(Exception):
    pass


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def sft_batch(model_dir: Path, forward_only: bool = False) -> ForwardBackwardBatch:
    ids = np.array(transformers.AutoTokenizer.from_pretrained(str(model_dir))(TEXT)["input_ids"], np.int64)
    datum = TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, np.float32)})
    return ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=forward_only)


def trainer_state(trainer: TorchTrainer, names: list[str]) -> list[torch.Tensor]:
    tensors = offload.module_tensors(trainer._model)
    for name in names:
        tensors += trainer._adapters[name].optimizer.live_state()
    return tensors


def gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def tensor_bytes(device: torch.device) -> int:
    """What the caching allocator holds for tensors on `device`, cuBLAS's workspaces left out.

    Each thread that runs a matmul gets a cuBLAS handle whose workspace comes from the same
    allocator (tens of MiB on Hopper), so memory_allocated grows with every new worker
    thread; the workspaces are freed first (no kernel is in flight after the synchronize)."""
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated(device)


def release() -> None:
    """Collect what is no longer referenced, now: a trainer's park slot holds a bound method of
    the trainer (a reference cycle), so an engine dropped by its last name keeps its device
    memory until the GC happens to run."""
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# Offload (issue 6)


def check_trainer_round_trip(model_dir: Path, device: torch.device) -> str:
    trainer = TorchTrainer(model_dir, device)
    batch = sft_batch(model_dir)
    trainer.add_adapter("a", SPEC)
    trainer.forward_backward("a", batch)
    trainer.optim_step("a", AdamParams(learning_rate=1e-2))
    trainer.forward_backward("a", batch)  # gradients to park as well
    state = trainer_state(trainer, ["a"])
    before = [t.detach().clone() for t in state]
    held = torch.cuda.memory_allocated(device)
    report = trainer.park()
    parked = trainer_state(trainer, ["a"])
    require(all(t.device.type == "cpu" and t.is_pinned() for t in parked), "a parked tensor is not in pinned host memory")
    require(report.bytes_moved == report.bytes_held > 0, f"moved {report.bytes_moved} of {report.bytes_held} bytes")
    require(report.device_bytes_freed >= report.bytes_moved, f"freed {report.device_bytes_freed} < moved {report.bytes_moved}")
    resumed = trainer.resume()
    after = trainer_state(trainer, ["a"])
    require([id(t) for t in after] == [id(t) for t in state], "resume changed the tensor objects")
    require(all(t.device == state[0].device for t in after), "a resumed tensor is not on the device")
    require(all(bit_equal(a, b) for a, b in zip(after, before)), "a tensor changed across park/resume")
    restored = torch.cuda.memory_allocated(device)
    require(restored >= held - 2**20, f"resume restored {gb(restored)} of the {gb(held)} held before park")
    return (
        f"{report.tensors} tensors, moved {gb(report.bytes_moved)}, freed {gb(report.device_bytes_freed)}, "
        f"reserved after {gb(report.device_bytes_reserved_after)}, park {report.seconds * 1e3:.1f} ms, "
        f"resume {resumed.seconds * 1e3:.1f} ms, bit-identical"
    )


def check_training_across_park(model_dir: Path, device: torch.device) -> str:
    trainer = TorchTrainer(model_dir, device)
    batch = sft_batch(model_dir)
    trainer.add_adapter("a", SPEC)
    trainer.add_adapter("b", SPEC)

    def step(name: str) -> float:
        loss = trainer.forward_backward(name, batch).metrics["loss:sum"]
        trainer.optim_step(name, AdamParams(learning_rate=1e-2))
        return loss

    losses_a = [step("a") for _ in range(2)]
    trainer.park()
    trainer.resume()
    losses_a += [step("a") for _ in range(2)]
    losses_b = [step("b") for _ in range(4)]
    require(losses_a == losses_b, f"losses differ: parked {losses_a} vs {losses_b}")
    a, b = trainer.adapter_tensors("a"), trainer.adapter_tensors("b")
    require(all(bit_equal(a[k], b[k]) for k in a), "adapter weights differ after training across a park")
    return f"4 steps, losses {[f'{x:.6f}' for x in losses_a]} identical with and without a park"


def check_trainer_process(model_dir: Path, device: torch.device) -> str:

    from openrld.worker.client import RemoteTrainer
    from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
    from openrld.worker.launchers.process import ProcessLauncher
    from openrld.worker.protocol import Start

    start = time.perf_counter()
    spec = WorkerSpec(
        name="gpu-check trainer", role="trainer",
        start=Start("lora_trainer", str(model_dir), str(device), options={"max_batch_tokens": 8192}),
    )
    remote = RemoteTrainer(start_worker(ProcessLauncher(), spec, socket_directory())[0])
    started = time.perf_counter() - start
    try:
        local = TorchTrainer(model_dir, device)
        batch, adam = sft_batch(model_dir), AdamParams(learning_rate=1e-2)
        losses: list[list[float]] = [[], []]
        for engine, out in zip((remote, local), losses):
            engine.add_adapter("a", SPEC, "adamw")
            for _ in range(3):
                results, _ = engine.forward_backward_then_step("a", [batch], adam)
                out.append(results[0].metrics["loss:sum"])
        require(np.allclose(losses[0], losses[1], rtol=0, atol=1e-5), f"losses differ: {losses[0]} vs {losses[1]}")
        from openrld.worker.values import local_payload

        tensors, expected = local_payload(remote.adapter_tensors("a")), local.adapter_tensors("a")
        require(sorted(tensors) == sorted(expected), "the worker's adapter has other tensors")
        worst = max(float((tensors[k].cpu() - expected[k].cpu()).abs().max()) for k in tensors)
        require(worst <= 1e-5, f"adapter tensors differ from the in-process trainer's by {worst:.2e}")
        parked = remote.park()
        remote.resume()
        # The park report is measured inside the worker: its state was on its CUDA device, and
        # parking freed that device memory (a worker that fell back to the CPU fails here).
        require(parked.device.startswith("cuda"), f"the worker's trainer parked from {parked.device}, not a CUDA device")
        require(parked.device_bytes_freed >= parked.bytes_moved > 0,
                f"the worker's park freed {parked.device_bytes_freed} device bytes of {parked.bytes_moved} moved")
        after, _ = remote.forward_backward_then_step("a", [batch], None)
        return (
            f"started in {started:.1f} s, losses {[f'{x:.6f}' for x in losses[0]]} as in process, "
            f"parked {gb(parked.bytes_moved)} from {parked.device} (freed {gb(parked.device_bytes_freed)}), "
            f"loss after resume {after[0].metrics['loss:sum']:.6f}"
        )
    finally:
        remote.close()


def check_sampler_round_trip(model_dir: Path, device: torch.device) -> str:
    sampler = TorchSampler(model_dir, device)
    prompt = np.array(transformers.AutoTokenizer.from_pretrained(str(model_dir))(TEXT)["input_ids"], np.int64)
    job = SampleJob(prompt=prompt, num_samples=4, params=SamplingSpec(max_tokens=16, seed=7, stop_at_eos=False))
    expected = sampler.sample(None, job)
    report = sampler.park()
    sampler.resume()
    got = sampler.sample(None, job)
    for a, b in zip(got.sequences, expected.sequences):
        require(a.tokens.tolist() == b.tokens.tolist(), "tokens differ after park/resume")
        require(np.array_equal(a.logprobs, b.logprobs), "logprobs differ after park/resume")
    return f"moved {gb(report.bytes_moved)}, freed {gb(report.device_bytes_freed)}, same seeded tokens and logprobs"


def build_wide_model(out: Path, hidden: int, layers: int, intermediate: int, head_dim: int) -> Path:
    """A random Llama of the given width with the tiny tokenizer, saved in bf16."""
    tokenizer = build_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim, num_key_value_heads=max(1, hidden // head_dim // 2), head_dim=head_dim,
        max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# Park and resume copy tensor by tensor into pinned memory; a bare copy of the same bytes as
# one tensor between the device and a pinned buffer is the link's speed. Below half of it, the
# copies go through pageable memory or wait on each other.
THROUGHPUT_SHARE = 0.5


def bare_copy_gbps(nbytes: int, device: torch.device) -> tuple[float, float]:
    """(device to host, host to device) GB/s of one pinned copy of `nbytes`, best of three."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out, back = [], []
    for _ in range(3):
        for source, target, times in ((on_device, pinned, out), (pinned, on_device, back)):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return nbytes / min(out) / 1e9, nbytes / min(back) / 1e9


def check_throughput(root: Path, device: torch.device) -> str:
    model_dir = build_wide_model(root / "wide", hidden=1024, layers=8, intermediate=2816, head_dim=64)
    trainer = TorchTrainer(model_dir, device)
    trainer.add_adapter("a", SPEC)
    trainer.park()  # warm the pinned-memory pool once, as a time-slicer's second turn would find it
    trainer.resume()
    park = trainer.park()
    resume = trainer.resume()
    out, back = bare_copy_gbps(park.bytes_moved, device)
    park_gbps, resume_gbps = park.bytes_moved / park.seconds / 1e9, resume.bytes_moved / resume.seconds / 1e9
    require(park_gbps >= THROUGHPUT_SHARE * out, f"park {park_gbps:.1f} GB/s < {THROUGHPUT_SHARE} x a bare pinned copy's {out:.1f}")
    require(resume_gbps >= THROUGHPUT_SHARE * back, f"resume {resume_gbps:.1f} GB/s < {THROUGHPUT_SHARE} x a bare pinned copy's {back:.1f}")
    return (
        f"{gb(park.bytes_moved)}: park {park_gbps:.1f} GB/s ({park.seconds * 1e3:.0f} ms, {park_gbps / out:.2f} of a bare "
        f"pinned copy's {out:.1f}), resume {resume_gbps:.1f} GB/s ({resume.seconds * 1e3:.0f} ms, {resume_gbps / back:.2f} "
        f"of {back:.1f}), freed {gb(park.device_bytes_freed)}"
    )


# ---------------------------------------------------------------------------
# The torch sampler, the full trainer, delta sync and the time-slicer on CUDA


def check_torch_sampler_logprobs(model_dir: Path, device: torch.device) -> str:
    sampler = TorchSampler(model_dir, device, torch.float32)
    trainer = TorchTrainer(model_dir, device, dtype=torch.float32)
    trainer.add_adapter("zero", LoraSpec(rank=8, seed=1))  # B = 0: the base model exactly
    prompt = np.array(transformers.AutoTokenizer.from_pretrained(str(model_dir))(TEXT)["input_ids"], np.int64)
    job = SampleJob(prompt=prompt, num_samples=2, prompt_logprobs=True,
                    params=SamplingSpec(max_tokens=8, seed=5, stop_at_eos=False))
    result = sampler.sample(None, job)
    worst = 0.0
    for sequence in result.sequences:
        ids = np.concatenate([prompt, sequence.tokens.astype(np.int64)])
        datum = TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, np.float32)})
        expected = trainer.forward_backward("zero", ForwardBackwardBatch(
            data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=True)).logprobs[0]
        worst = max(worst, float(np.abs(sequence.logprobs - expected[len(prompt) - 1:]).max()))
        worst = max(worst, float(np.abs(result.prompt_logprobs[1:] - expected[: len(prompt) - 1]).max()))
    require(worst <= FP32_TOLERANCE, f"max |torch sampler - trainer forward| = {worst:.2e} > {FP32_TOLERANCE}")
    return f"max |diff| {worst:.2e} over 2x8 sampled + prompt logprobs (fp32)"


def full_losses(trainer, steps: int, batch: ForwardBackwardBatch, lr: float = 1e-4) -> list[float]:
    trainer.add_adapter("job", None, "adamw")
    losses = []
    for _ in range(steps):
        results, _ = trainer.forward_backward_then_step("job", [batch], AdamParams(learning_rate=lr))
        losses.append(results[0].metrics["loss:sum"])
    return losses


def check_full_trainer_bf16(model_dir: Path, device: torch.device) -> str:
    from openrld.gpu.full_trainer import FullTrainer

    batch = sft_batch(model_dir)
    gpu = FullTrainer(model_dir, device, torch.bfloat16)
    cpu = FullTrainer(model_dir, torch.device("cpu"), torch.float32)
    on_gpu, on_cpu = full_losses(gpu, 4, batch), full_losses(cpu, 4, batch)
    worst = max(abs(a - b) / abs(b) for a, b in zip(on_gpu, on_cpu))
    require(worst <= 2e-2, f"bf16 GPU losses {on_gpu} vs fp32 CPU {on_cpu}: {worst:.2e} relative")
    master, weights = gpu.master_weights(), gpu.adapter_tensors("job")
    require(sorted(master) == sorted(weights), f"{len(master)} master copies for {len(weights)} weights")
    require(all(bit_equal(weights[k], master[k].to(torch.bfloat16).cpu()) for k in weights), "weights are not the master rounded")
    kept = sum(int((master[k].cpu() != weights[k].float()).sum()) for k in weights)
    require(kept > 0, "the fp32 master holds nothing the bf16 weights do not")
    return f"losses within {worst:.1e} of the fp32 CPU run; {kept} master elements below bf16 rounding kept"


def start_worker_engine(kind: str, role: str, model_dir: Path, device: torch.device, options: dict):
    from openrld.worker.client import RemoteSampler, RemoteTrainer
    from openrld.worker.launchers import WorkerSpec, socket_directory, start_worker
    from openrld.worker.launchers.process import ProcessLauncher
    from openrld.worker.protocol import Start

    spec = WorkerSpec(name=f"gpu-check {kind}", role=role, start=Start(kind, str(model_dir), str(device), options=options))
    connection = start_worker(ProcessLauncher(), spec, socket_directory())[0]
    return RemoteTrainer(connection) if role == "trainer" else RemoteSampler(connection)


def check_full_trainer_worker(model_dir: Path, device: torch.device) -> str:
    from openrld.gpu.full_trainer import FullTrainer

    batch = sft_batch(model_dir)
    remote = start_worker_engine("full_trainer", "trainer", model_dir, device, {"max_batch_tokens": 8192, "weight_sync": "delta"})
    try:
        local = FullTrainer(model_dir, device)
        got, expected = full_losses(remote, 3, batch), full_losses(local, 3, batch)
        require(got == expected, f"worker losses {got} != in-process {expected}")
        parked = remote.park()
        remote.resume()
        # Measured inside the worker: its weights and AdamW state were on a CUDA device, and parking freed memory there.
        require(parked.device.startswith("cuda"), f"the worker's trainer parked from {parked.device}, not a CUDA device")
        require(parked.bytes_moved > 0 and parked.device_bytes_freed > 0,
                f"the worker's park moved {parked.bytes_moved} bytes and freed {parked.device_bytes_freed} device bytes")
        return (
            f"3 steps bit-identical to in process ({[f'{x:.6f}' for x in got]}), parked {gb(parked.bytes_moved)} "
            f"from {parked.device} (freed {gb(parked.device_bytes_freed)})"
        )
    finally:
        remote.close()


def check_delta_sync(model_dir: Path, device: torch.device) -> str:
    from openrld.gpu.full_sampler import FullSampler
    from openrld.gpu.full_trainer import FullTrainer

    batch = sft_batch(model_dir)
    trainer = FullTrainer(model_dir, device, weight_sync="delta")
    sampler = FullSampler(model_dir, device)
    trainer.add_adapter("job", None, "adamw")
    allocated: list[int] = []
    moved = 0
    for step in range(10):
        trainer.forward_backward_then_step("job", [batch], AdamParams(learning_rate=1e-4))
        payload = trainer.sampler_payload("job", f"v{step}")
        require(all(t.values.device.type == "cpu" for t in payload.tensors), "a payload holds device tensors")
        sampler.load_version(f"v{step}", payload)  # checks the digest: WeightMismatch otherwise
        if step >= 1:
            sampler.drop_version(f"v{step - 1}")
        moved += payload.bytes_moved
        torch.cuda.synchronize(device)
        allocated.append(torch.cuda.memory_allocated(device))
    live, trained = sampler.live_weights(), trainer.live_tensors("job")
    require(all(bit_equal(live[k], trained[k]) for k in trained), "the sampler's weights differ from the trainer's")
    growth = allocated[-1] - allocated[0]
    require(growth <= 2**20, f"device memory grew by {gb(growth)} over 9 syncs: {[gb(a) for a in allocated]}")
    stats = trainer.last_sync
    return (
        f"10 syncs, {gb(moved)} moved in all, last changed {stats.changed_fraction:.3f} of the weights; "
        f"device memory {gb(allocated[0])} after the first and {gb(allocated[-1])} after the tenth"
    )


def workspace_kept_per_thread(device: torch.device) -> int:
    """What a new thread's cuBLAS workspace still holds after `tensor_bytes` cleared what it can:
    0 where torch keeps every thread's workspace in the one map it clears, a workspace where it
    keeps them per thread."""
    a = torch.ones(64, 64, device=device)
    before = tensor_bytes(device)
    thread = threading.Thread(target=lambda: torch.mm(a, a))
    thread.start()
    thread.join()
    return tensor_bytes(device) - before


def check_timeslicer_two_jobs(root: Path, device: torch.device) -> str:
    import trio

    from openrld.actors.timeslicer import TimeSlicer
    from openrld.gpu.full_trainer import FullTrainer

    # ~47M parameters (~0.8 GB a job after a step): a footprint far above the cuBLAS workspaces.
    model_dir = build_wide_model(root / "two-jobs", hidden=1024, layers=4, intermediate=2816, head_dim=64)
    batch, steps = sft_batch(model_dir), 4
    release()
    kept = workspace_kept_per_thread(device)
    threads: set[int] = set()  # the threads trio ran engine calls on: each may keep a workspace

    def on_thread(call: Callable, *args: object):
        threads.add(threading.get_ident())
        return call(*args)

    baseline = tensor_bytes(device)  # nothing of ours on the device
    solo = FullTrainer(model_dir, device)
    alone = full_losses(solo, steps, batch)
    # One job's footprint after its steps: weights, delta shadow, AdamW's two moments (and the
    # fp32 master of bf16 weights), what a job holds at every turn after its first.
    footprint = tensor_bytes(device) - baseline
    solo.close()
    del solo
    release()
    left = tensor_bytes(device) - baseline
    require(left <= 2**20, f"the job run alone still holds {gb(left)} after it was closed and collected")
    limiter = trio.CapacityLimiter(1)
    turns: list[tuple[str, int]] = []
    parks = [0]

    class Parks:
        def __init__(self, engine) -> None:
            self.engine = engine

        async def park(self) -> bool:
            await trio.to_thread.run_sync(on_thread, self.engine.park, limiter=limiter)
            parks[0] += 1
            return True

        async def resume(self) -> None:
            await trio.to_thread.run_sync(on_thread, self.engine.resume, limiter=limiter)

    async def job(name: str, lease, engine, out: list[float]) -> None:
        for done in range(1, steps + 1):
            async with lease.hold(has_more=lambda done=done: done < steps):
                turns.append((name, tensor_bytes(device) - baseline - kept * len(threads)))
                results, _ = await trio.to_thread.run_sync(
                    on_thread, engine.forward_backward_then_step, "job", [batch], AdamParams(learning_rate=1e-4),
                    limiter=limiter,
                )
                out.append(results[0].metrics["loss:sum"])
        lease.close()

    engines = {name: FullTrainer(model_dir, device) for name in ("a", "b")}
    for engine in engines.values():
        engine.add_adapter("job", None, "adamw")
    losses: dict[str, list[float]] = {"a": [], "b": []}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            slicer = await nursery.start(TimeSlicer(str(device), quantum_s=0.0).run)
            leases = {name: slicer.register(name, name, Parks(engine)) for name, engine in engines.items()}
            for name, lease in leases.items():
                if not lease.claim_resident():  # another party is on the device: park until its turn
                    engines[name].park()
            async with trio.open_nursery() as jobs:
                for name, engine in engines.items():
                    jobs.start_soon(job, name, leases[name], engine, losses[name])
            nursery.cancel_scope.cancel()

    trio.run(main)
    require(losses["a"] == alone and losses["b"] == alone, f"losses {losses} differ from the job alone {alone}")
    require(parks[0] >= 1, "no job was ever parked")
    worst = max(held for _, held in turns)
    # Two resident jobs would hold twice the footprint at a turn; one resident and one parked, one.
    require(worst <= 1.5 * footprint, f"{gb(worst)} held at a turn, one job holds {gb(footprint)}: the other was not parked")
    return (
        f"{len(turns)} turns, {parks[0]} parks, at most {gb(worst)} held at a turn = {worst / footprint:.2f} x one job's "
        f"{gb(footprint)} after its steps (bound 1.5; cuBLAS workspace kept per thread {gb(kept)}, "
        f"{len(threads)} threads); losses as alone"
    )


def check_launcher_measurement(model_dir: Path, device: torch.device) -> str:
    batch, adam, steps = sft_batch(model_dir), AdamParams(learning_rate=1e-3), 30

    def run_pair(engines) -> float:
        for engine in engines:
            engine.add_adapter("a", SPEC, "adamw")
            engine.forward_backward_then_step("a", [batch], adam)  # warm
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        threads = [threading.Thread(target=lambda e=e: [e.forward_backward_then_step("a", [batch], adam) for _ in range(steps)])
                   for e in engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return 2 * steps / (time.perf_counter() - start)

    threads = [TorchTrainer(model_dir, device), TorchTrainer(model_dir, device)]
    inproc = run_pair(threads)
    del threads
    release()  # the two in-process trainers' memory, before the workers take theirs
    workers = [start_worker_engine("lora_trainer", "trainer", model_dir, device, {"max_batch_tokens": 8192}) for _ in range(2)]
    try:
        process = run_pair(workers)
    finally:
        for worker in workers:
            worker.close()
    return (
        f"two LoRA trainers on one GPU: {inproc:.1f} steps/s as threads of one process (one CUDA context, one GIL), "
        f"{process:.1f} steps/s as two process workers (a context each): process/inproc = {process / inproc:.2f}"
    )


# ---------------------------------------------------------------------------
# vLLM (issue 4)


class VllmSetup:
    def __init__(self, root: Path, device: torch.device) -> None:
        from openrld.gpu.vllm_sampler import VllmSampler, VllmSamplerConfig

        self.model_dir = build_wide_model(root / "vllm-tiny", hidden=256, layers=2, intermediate=512, head_dim=64)
        self.device = device
        self.engine = None
        errors = []
        for dtype, tolerance in (("float32", FP32_TOLERANCE), ("bfloat16", BF16_TOLERANCE)):
            try:
                config = VllmSamplerConfig(
                    gpu_memory_utilization=0.3, dtype=dtype, enforce_eager=True, max_model_len=VLLM_CONTEXT,
                    max_lora_rank=8,
                )
                self.engine = VllmSampler(self.model_dir, device, config)
                self.dtype, self.tolerance = dtype, tolerance
                break
            except Exception as error:  # vLLM may refuse fp32 attention; then compare in bf16
                errors.append(f"{dtype}: {type(error).__name__}: {error}")
        if self.engine is None:
            raise RuntimeError("; ".join(errors))
        self.torch_dtype = torch.float32 if self.dtype == "float32" else torch.bfloat16
        self.reference = transformers.AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=self.torch_dtype)
        self.reference.to(device).eval()
        self.trainer = TorchTrainer(self.model_dir, device, dtype=self.torch_dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.model_dir))
        self.prompt = np.array(tokenizer(TEXT)["input_ids"], np.int64)

    def job(self, **params: object) -> SampleJob:
        return SampleJob(
            prompt=self.prompt, num_samples=2, prompt_logprobs=True,
            params=SamplingSpec(**{"max_tokens": 8, "seed": 5, "stop_at_eos": False, **params}),  # type: ignore[arg-type]
        )

    def trainer_logprobs(self, adapter: str, tokens: list[int], trainer: object = None) -> np.ndarray:
        """The trainer's forward lp of tokens[1:] given their prefixes (`trainer`: another than the LoRA one)."""
        ids = np.array(tokens, np.int64)
        datum = TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, np.float32)})
        batch = ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=True)
        return (trainer or self.trainer).forward_backward(adapter, batch).logprobs[0]  # type: ignore[attr-defined]

    def tempered_logprobs(self, tokens: list[int], temperature: float) -> np.ndarray:
        with torch.no_grad():
            logits = self.reference(torch.tensor([tokens], device=self.device)).logits[0].float()
        logq = torch.log_softmax(logits / temperature, dim=-1)[:-1]
        return logq.gather(-1, torch.tensor(tokens[1:], device=self.device)[:, None])[:, 0].cpu().numpy()


def compare_sampled(setup: VllmSetup, adapter: str, result, trainer: object = None) -> float:
    """Largest |vLLM - trainer| over the generated tokens' and the prompt's logprobs."""
    prompt = setup.prompt.tolist()
    worst = 0.0
    for sequence in result.sequences:
        expected = setup.trainer_logprobs(adapter, prompt + sequence.tokens.tolist(), trainer)
        worst = max(worst, float(np.abs(sequence.logprobs - expected[len(prompt) - 1 :]).max()))
        worst = max(worst, float(np.abs(result.prompt_logprobs[1:] - expected[: len(prompt) - 1]).max()))
    return worst


def check_vllm_base_logprobs(setup: VllmSetup) -> str:
    setup.trainer.add_adapter("zero", LoraSpec(rank=8, seed=1))  # B = 0: the base model exactly
    result = setup.engine.sample(None, setup.job())
    worst = compare_sampled(setup, "zero", result)
    require(worst <= setup.tolerance, f"max |vLLM - trainer forward| = {worst:.2e} > {setup.tolerance} ({setup.dtype})")
    again = setup.engine.sample(None, setup.job())
    require([s.tokens.tolist() for s in again.sequences] == [s.tokens.tolist() for s in result.sequences], "seed did not reproduce")
    require(result.sequences[0].tokens.tolist() != result.sequences[1].tokens.tolist(), "two samples drew the same tokens")
    return f"{setup.dtype}: max |diff| {worst:.2e} over 2x8 sampled + prompt logprobs; seed reproduces"


def check_vllm_temperature(setup: VllmSetup) -> str:
    result = setup.engine.sample(None, setup.job(temperature=0.7))
    prompt = setup.prompt.tolist()
    worst = 0.0
    for sequence in result.sequences:
        expected = setup.tempered_logprobs(prompt + sequence.tokens.tolist(), 0.7)[len(prompt) - 1 :]
        worst = max(worst, float(np.abs(sequence.logprobs - expected).max()))
    require(worst <= setup.tolerance, f"max |vLLM - log_softmax(logits/0.7)| = {worst:.2e} (raw logprobs reported?)")
    return f"T=0.7 sampled logprobs are log q_T: max |diff| {worst:.2e}"


def refusal(setup: VllmSetup, request_id: str, job: SampleJob) -> BadRequest:
    """The BadRequest `add` raises for `job`; the engine must hold no work after it."""

    try:
        setup.engine.add(request_id, None, job)
    except BadRequest as refused:
        require(not setup.engine.has_work(), f"{request_id}: the refused request left work in the engine")
        return refused
    raise AssertionError(f"{request_id}: accepted")


def check_vllm_refusal(setup: VllmSetup) -> str:
    """openrld's own limit first, then vLLM's own validation with openrld's checks stepped aside:
    SamplingParams refusing T = 2.5 (VLLMValidationError naming temperature) and vLLM's input
    processor refusing a prompt as long as the context; each a 400 for that request alone."""
    ours = refusal(setup, "too-hot", setup.job(temperature=2.5))
    require(ours.key == "sampling_params.temperature", f"openrld's refusal names {ours.key}")
    setup.engine.validate = lambda job: None  # type: ignore[method-assign]  # vLLM sees what openrld would refuse
    try:
        params = refusal(setup, "too-hot-for-vllm", setup.job(temperature=2.5))
        # As long as vLLM's context: no room for the one token vLLM generates even to score a prompt.
        long_prompt = np.resize(setup.prompt, VLLM_CONTEXT)
        prompt = refusal(setup, "too-long-for-vllm", SampleJob(
            prompt=long_prompt, num_samples=1, prompt_logprobs=True, params=SamplingSpec(max_tokens=1, seed=5)))
    finally:
        del setup.engine.validate
    mapped = "the vLLM sampler refused the request: "  # VllmSampler.add's mapping of VLLMValidationError
    for refused in (params, prompt):
        require(refused.detail.startswith(mapped), f"not vLLM's refusal: {refused.detail}")
    require(params.key == "sampling_params.temperature", f"vLLM's SamplingParams refusal names {params.key}")
    result = setup.engine.sample(None, setup.job(temperature=2.0))
    require(len(result.sequences) == 2, "the engine stopped serving after a refusal")
    return (
        f"T=2.5: openrld's 400 ({ours.key}); vLLM's own: {params.detail[len(mapped):][:60]!r} ({params.key}), "
        f"{prompt.detail[len(mapped):][:70]!r}; T=2.0 served after"
    )


def check_vllm_lora(setup: VllmSetup) -> str:
    spec = LoraSpec(rank=8, seed=3)
    setup.trainer.add_adapter("trained", spec)
    batch = sft_batch(setup.model_dir)
    for _ in range(3):  # moves B off zero, so the adapter changes the logits
        setup.trainer.forward_backward("trained", batch)
        setup.trainer.optim_step("trained", AdamParams(learning_rate=2e-2))
    tensors = setup.trainer.adapter_tensors("trained")
    setup.engine.load_version("v1", tensors, spec)
    result = setup.engine.sample("v1", setup.job())
    worst = compare_sampled(setup, "trained", result)
    require(worst <= setup.tolerance, f"LoRA version: max |vLLM - trainer forward| = {worst:.2e} > {setup.tolerance}")
    base = setup.trainer_logprobs("zero", setup.prompt.tolist() + result.sequences[0].tokens.tolist())
    lora = setup.trainer_logprobs("trained", setup.prompt.tolist() + result.sequences[0].tokens.tolist())
    effect = float(np.abs(base - lora).max())
    require(effect > 10 * setup.tolerance, f"the adapter barely changes logprobs ({effect:.2e}); the check proves nothing")
    setup.engine.drop_version("v1")
    setup.engine.load_version("v1", tensors, spec)  # back under a new adapter name and id
    again = setup.engine.sample("v1", setup.job())
    require([s.tokens.tolist() for s in again.sequences] == [s.tokens.tolist() for s in result.sequences], "reload changed tokens")
    return f"max |diff| {worst:.2e} (adapter effect {effect:.2e}); reloaded under a new name, same tokens"


def check_vllm_sleep(setup: VllmSetup) -> str:
    before = setup.engine.sample(None, setup.job())
    report = setup.engine.sleep()
    try:
        setup.engine.step()
        raise AssertionError("step() ran on a sleeping engine")
    except offload.EngineParked:
        pass
    require(report.device_bytes_freed > 0, f"sleep freed {report.device_bytes_freed} bytes")
    woke = setup.engine.wake()
    after = setup.engine.sample(None, setup.job())
    require([s.tokens.tolist() for s in after.sequences] == [s.tokens.tolist() for s in before.sequences], "tokens changed")
    return f"sleep freed {gb(report.device_bytes_freed)} in {report.seconds:.2f} s, wake {woke.seconds:.2f} s, same tokens"


def check_vllm_full_sync(setup: VllmSetup) -> str:
    """A full fine-tuning job on vLLM (issue 38, item 5): three delta syncs from a FullTrainer
    patched into vLLM's weights in place, each digest-checked on vLLM's read-back weights; then
    vLLM's weights equal the trainer's bit for bit and its logprobs the trainer's forward; a sync
    that arrives asleep lands at the first step after wake."""
    from openrld.gpu.full_trainer import FullTrainer
    from openrld.gpu.vllm_sampler import VllmSamplerConfig
    from openrld.gpu.vllm_weights import vllm_full_sampler

    trainer = FullTrainer(setup.model_dir, setup.device, setup.torch_dtype, weight_sync="delta")
    trainer.add_adapter("job", None, "adamw")
    config = VllmSamplerConfig(gpu_memory_utilization=0.2, dtype=setup.dtype, enforce_eager=True, max_model_len=VLLM_CONTEXT)
    sampler = vllm_full_sampler(setup.model_dir, setup.device, config)
    batch = sft_batch(setup.model_dir)

    def sync(version: str) -> int:
        trainer.forward_backward_then_step("job", [batch], AdamParams(learning_rate=1e-3))
        payload = trainer.sampler_payload("job", version)
        sampler.load_version(version, payload)  # WeightMismatch unless vLLM's read-back digest is the trainer's
        return payload.bytes_moved

    try:
        moved = [sync(f"v{step}") for step in range(3)]
        live, trained = sampler.live_weights(), trainer.sampler_tensors("job")
        require(all(bit_equal(live[k], trained[k]) for k in trained), "vLLM's weights differ from the trainer's")
        worst = compare_sampled(setup, "job", sampler.sample("v2", setup.job()), trainer)
        require(worst <= setup.tolerance, f"max |vLLM - full trainer forward| = {worst:.2e} > {setup.tolerance}")
        slept = sampler.park()
        moved.append(sync("v3"))  # waits while vLLM's weights are off the device
        sampler.resume()
        sampler.step()  # the first step after waking lands it
        live, trained = sampler.live_weights(), trainer.sampler_tensors("job")
        require(all(bit_equal(live[k], trained[k]) for k in trained), "the sync made asleep did not land at wake")
        return (
            f"4 syncs ({', '.join(gb(m) for m in moved)} of {gb(sampler.last_sync.full_bytes)}), vLLM's weights the "
            f"trainer's bit for bit, logprobs within {worst:.2e}; slept (freed {gb(slept.device_bytes_freed)}) across a sync"
        )
    finally:
        sampler.close()


# ---------------------------------------------------------------------------


def main(prefixes: list[str]) -> int:
    """Run the checks whose names start with one of `prefixes` (all of them when none is given)."""
    report = Report()

    def chosen(name: str) -> bool:
        return not prefixes or any(name.startswith(prefix) for prefix in prefixes)

    has_cuda = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    print(f"torch {torch.__version__}, cuda {'yes: ' + torch.cuda.get_device_name() if has_cuda else 'no'}, "
          f"vllm {'yes' if has_vllm else 'no'}", flush=True)
    device = torch.device("cuda:0")
    with tempfile.TemporaryDirectory(prefix="openrld-gpu-check-") as tmp:
        root = Path(tmp)
        tiny = build_tiny_model(root / "tiny-llama", "llama", seed=0)
        cuda_checks = {
            "offload.trainer_round_trip": lambda: check_trainer_round_trip(tiny, device),
            "offload.training_across_park": lambda: check_training_across_park(tiny, device),
            "offload.sampler_round_trip": lambda: check_sampler_round_trip(tiny, device),
            "offload.throughput": lambda: check_throughput(root, device),
            "sampler.torch_logprobs": lambda: check_torch_sampler_logprobs(tiny, device),
            "worker.cuda_trainer": lambda: check_trainer_process(tiny, device),
            "full.trainer_bf16": lambda: check_full_trainer_bf16(tiny, device),
            "worker.cuda_full_trainer": lambda: check_full_trainer_worker(tiny, device),
            "delta.sync_10": lambda: check_delta_sync(tiny, device),
            "timeslicer.two_jobs": lambda: check_timeslicer_two_jobs(root, device),
            "worker.launcher_measurement": lambda: check_launcher_measurement(tiny, device),
        }
        for name, check in cuda_checks.items():
            why = "no CUDA device here" if not has_cuda else None if chosen(name) else "not selected"
            report.run(name, check if why is None else _skip(why), measure=name in MEASUREMENTS)
            if why is None:
                release()  # each check starts from a device the last one left clean
        vllm_checks = {
            "vllm.base_logprobs": check_vllm_base_logprobs, "vllm.temperature_logprobs": check_vllm_temperature,
            "vllm.refusal_is_a_400": check_vllm_refusal, "vllm.lora_version": check_vllm_lora,
            "vllm.sleep_wake": check_vllm_sleep, "vllm.full_sync": check_vllm_full_sync,
        }
        why_not = "no CUDA device here" if not has_cuda else "vllm is not installed here" if not has_vllm else None
        setup_box: list[VllmSetup] = []
        if why_not is None and any(chosen(name) for name in vllm_checks):
            report.run("vllm.engine_start", lambda: _start(setup_box, root, device))
            why_not = None if setup_box else "the vLLM engine did not start"
        for name, vllm_check in vllm_checks.items():
            why = why_not or (None if chosen(name) else "not selected")
            report.run(name, (lambda check=vllm_check: check(setup_box[0])) if why is None else _skip(why))
        if setup_box:
            setup_box[0].engine.close()
    print(f"{'FAILED' if report.failed else 'OK'}: {report.failed} check(s) failed", flush=True)
    return 1 if report.failed else 0


def _start(box: list[VllmSetup], root: Path, device: torch.device) -> str:
    start = time.perf_counter()
    box.append(VllmSetup(root, device))
    return f"dtype {box[0].dtype}, started in {time.perf_counter() - start:.0f} s"


def _skip(why: str) -> Callable[[], str]:
    def skip() -> str:
        raise Skip(why)

    return skip


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    sys.exit(main(sys.argv[1:]))

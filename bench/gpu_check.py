"""The device check for issues 4 and 6: CUDA offload of engines, and the vLLM sampler engine.

One script, about five minutes on one GPU, one line per check:
    PASS <check>: <figures>    FAIL <check>: <what differed>    SKIP <check>: <why>
and exit status 1 when any check failed. Without CUDA every check SKIPs (so it runs
anywhere, as CI-less proof that it starts); without vLLM the vLLM checks SKIP.

Checks:
- offload.trainer_round_trip: a tiny Llama TorchTrainer on cuda with an adapter, its
  gradients and AdamW moments; park() moves them all to pinned host memory and frees
  the device (device_bytes_freed >= bytes_moved); resume() brings back every tensor
  bit for bit, the same tensor objects.
- offload.training_across_park: two adapters with the same seed, one parked and
  resumed between its steps, give identical losses and identical weights.
- offload.sampler_round_trip: a TorchSampler parked and resumed samples the same
  seeded tokens and logprobs as before.
- offload.throughput: park/resume of a ~100M-parameter bf16 model: GB/s each way.
- worker.cuda_trainer: a TorchTrainer on cuda in a process worker (the worker protocol)
  (`trainer_process = true`) trains as the in-process one does (losses within 1e-5),
  hands back adapter tensors on the device, and parks and resumes through the pipe.
- vllm.*: a tiny random Llama (head_dim 64) served by VllmSampler: sampled-token and
  prompt logprobs at T = 1 against the trainer's forward (1e-3 in fp32; 5e-2 if vLLM
  must run it in bf16), T = 0.7 logprobs against log_softmax(logits / 0.7), a seed
  reproducing its tokens, a LoRA version against the trainer's forward with that
  adapter, a reloaded version under a new adapter name, and sleep/wake (memory freed,
  the same seeded tokens after waking).

Run from the repository root: `PYTHONPATH=. python3 bench/gpu_check.py`. On the device
machine its image lacks msgspec, and its transformers (5.17 when last run) is older than
the 5.24 we pin, under which `gpu/kv_batch.py`'s cache handling fails (the sampler check
then fails on the CPU too); carry both as wheels (see the device README), adding
`transformers==5.24.0` to the download below:
    here:   echo /.whl/ >> .git/info/exclude
            python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
                --implementation cp --platform manylinux_2_17_x86_64 -d .whl msgspec==0.23.0
    there:  carry [".whl"]; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
                && PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 timeout 420 python3 bench/gpu_check.py
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers

from openrld.batches import AdamParams, ForwardBackwardBatch, LoraSpec, SampleJob, SamplingSpec, TrainDatum
from openrld.gpu import offload
from openrld.gpu.tiny_models import build_tiny_model, build_tokenizer
from openrld.gpu.torch_sampler import TorchSampler
from openrld.gpu.torch_trainer import TorchTrainer

TEXT = "User: what is two plus two? Assistant: four. The quick brown fox jumps over the lazy dog."
SPEC = LoraSpec(rank=8, seed=3)
FP32_TOLERANCE = 1e-3  # issue 4: sampled logprobs at T = 1 match the trainer's forward within 1e-3
BF16_TOLERANCE = 5e-2  # bf16 logits of a random model differ from fp32 by ~1e-2


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def run(self, name: str, check: Callable[[], str]) -> None:
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
        print(f"PASS {name}: {detail} ({time.perf_counter() - start:.1f} s)", flush=True)


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
    return f"4 steps, losses {['%.6f' % x for x in losses_a]} identical with and without a park"


def check_trainer_process(model_dir: Path, device: torch.device) -> str:
    from functools import partial

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
            engine.add_adapter("a", SPEC)
            for _ in range(3):
                results, _ = engine.forward_backward_then_step("a", [batch], adam)
                out.append(results[0].metrics["loss:sum"])
        require(np.allclose(losses[0], losses[1], rtol=0, atol=1e-5), f"losses differ: {losses[0]} vs {losses[1]}")
        tensors = remote.adapter_tensors("a")
        require(all(t.device == torch.device(device) for t in tensors.values()), "adapter tensors left the device")
        parked = remote.park()
        remote.resume()
        require(parked.bytes_moved > 0, "park moved nothing")
        after, _ = remote.forward_backward_then_step("a", [batch], None)
        return (
            f"started in {started:.1f} s, losses {['%.6f' % x for x in losses[0]]} as in process, "
            f"parked {gb(parked.bytes_moved)}, loss after resume {after[0].metrics['loss:sum']:.6f}"
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


def check_throughput(root: Path, device: torch.device) -> str:
    model_dir = build_wide_model(root / "wide", hidden=1024, layers=8, intermediate=2816, head_dim=64)
    trainer = TorchTrainer(model_dir, device)
    trainer.add_adapter("a", SPEC)
    trainer.park()  # warm the pinned-memory pool once, as a time-slicer's second turn would find it
    trainer.resume()
    park = trainer.park()
    resume = trainer.resume()
    return (
        f"{gb(park.bytes_moved)}: park {park.bytes_moved / park.seconds / 1e9:.1f} GB/s ({park.seconds * 1e3:.0f} ms), "
        f"resume {resume.bytes_moved / resume.seconds / 1e9:.1f} GB/s ({resume.seconds * 1e3:.0f} ms), "
        f"freed {gb(park.device_bytes_freed)}"
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
                    gpu_memory_utilization=0.3, dtype=dtype, enforce_eager=True, max_model_len=1024, max_lora_rank=8
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

    def trainer_logprobs(self, adapter: str, tokens: list[int]) -> np.ndarray:
        """The trainer's forward lp of tokens[1:] given their prefixes."""
        ids = np.array(tokens, np.int64)
        datum = TrainDatum(tokens=ids[:-1], inputs={"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1, np.float32)})
        batch = ForwardBackwardBatch(data=[datum], loss_fn="cross_entropy", loss_config={}, forward_only=True)
        return self.trainer.forward_backward(adapter, batch).logprobs[0]

    def tempered_logprobs(self, tokens: list[int], temperature: float) -> np.ndarray:
        with torch.no_grad():
            logits = self.reference(torch.tensor([tokens], device=self.device)).logits[0].float()
        logq = torch.log_softmax(logits / temperature, dim=-1)[:-1]
        return logq.gather(-1, torch.tensor(tokens[1:], device=self.device)[:, None])[:, 0].cpu().numpy()


def compare_sampled(setup: VllmSetup, adapter: str, result) -> float:
    """Largest |vLLM - trainer| over the generated tokens' and the prompt's logprobs."""
    prompt = setup.prompt.tolist()
    worst = 0.0
    for sequence in result.sequences:
        expected = setup.trainer_logprobs(adapter, prompt + sequence.tokens.tolist())
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


# ---------------------------------------------------------------------------


def main() -> int:
    report = Report()
    has_cuda = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    print(f"torch {torch.__version__}, cuda {'yes: ' + torch.cuda.get_device_name() if has_cuda else 'no'}, "
          f"vllm {'yes' if has_vllm else 'no'}", flush=True)
    device = torch.device("cuda:0")
    with tempfile.TemporaryDirectory(prefix="openrld-gpu-check-") as tmp:
        root = Path(tmp)
        tiny = build_tiny_model(root / "tiny-llama", "llama", seed=0)
        offload_checks = {
            "offload.trainer_round_trip": lambda: check_trainer_round_trip(tiny, device),
            "offload.training_across_park": lambda: check_training_across_park(tiny, device),
            "offload.sampler_round_trip": lambda: check_sampler_round_trip(tiny, device),
            "offload.throughput": lambda: check_throughput(root, device),
            "worker.cuda_trainer": lambda: check_trainer_process(tiny, device),
        }
        for name, check in offload_checks.items():
            report.run(name, check if has_cuda else _skip("no CUDA device here"))
        vllm_checks = ("vllm.base_logprobs", "vllm.temperature_logprobs", "vllm.lora_version", "vllm.sleep_wake")
        if not (has_cuda and has_vllm):
            for name in vllm_checks:
                report.run(name, _skip("no CUDA device here" if not has_cuda else "vllm is not installed here"))
        else:
            setup_box: list[VllmSetup] = []
            report.run("vllm.engine_start", lambda: _start(setup_box, root, device))
            if setup_box:
                setup = setup_box[0]
                for name, check in zip(
                    vllm_checks, (check_vllm_base_logprobs, check_vllm_temperature, check_vllm_lora, check_vllm_sleep)
                ):
                    report.run(name, lambda check=check: check(setup))
                setup.engine.close()
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
    sys.exit(main())

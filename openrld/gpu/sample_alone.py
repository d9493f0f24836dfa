"""Running one sampling request alone on a step-level sampler engine.

Tests, benchmarks and the doctor sample without a scheduler of their own; every
sampler engine (`TorchSampler`, `FullSampler`, `VllmSampler`) answers their
`sample(version, job)` with this one function, over its `SamplerEngine` calls: add
the request, step until it finishes, return its result.
"""

from __future__ import annotations

from openrld.batches import SampleJob, SampleResult
from openrld.engine_types import SamplerEngine

# The engine is idle while it runs the request, so one fixed id never meets another.
ALONE_REQUEST_ID = "sample-alone"


def sample_alone(engine: SamplerEngine, version: str | None, job: SampleJob) -> SampleResult:
    """`job` on `version` (None: the base model), run to completion on an idle `engine`.

    The engine must be idle: the results of other requests' steps would be lost.

    Raises:
        BadRequest, KeyError, ValueError: as the engine's `add`.  OpenrldError: the engine
            refused or failed the request in a step (`Finished.error`).
    """
    assert not engine.has_work(), "sampling one request alone needs an idle engine"
    engine.add(ALONE_REQUEST_ID, version, job)
    while True:
        for done in engine.step():
            if done.request_id == ALONE_REQUEST_ID:
                if done.error is not None:  # a worker's sampler refuses an add in the step after it
                    raise done.error
                assert done.result is not None, "a request that finished without an error has a result"
                return done.result

"""`openrl-doctor`: check an openrld deployment from a laptop in one command.

This module owns the checks and their report. It talks to a server only the
way a client does (HTTP, and the `tinker` SDK for the smoke run), so it works
from any machine that can reach the URL. It guarantees that every check ends
as ok, warn, fail or skip with one line saying what it found, that a failed
check says what to do next, and that the exit status is 0 when nothing
failed and 1 otherwise (2 for bad usage), so scripts can use it. It never
changes the server beyond the smoke run's own session, which it closes, and
never imports torch or the daemon's internals.

Checks, in order (a check that cannot run without an earlier one is skipped):
reachability, tls, auth, version, cluster, smoke.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import ssl
import sys
import time
from collections.abc import Callable
from importlib import metadata
from urllib.parse import urlsplit

import httpx
import msgspec

from openrld.config import is_loopback
from openrld.sdk_support import release

PROG = "openrl-doctor"
REQUEST_TIMEOUT_S = 30.0  # one HTTP check; a healthy node answers these in milliseconds
SMOKE_TIMEOUT_S = 600.0  # the whole smoke run, including a first model load on a cold node
SMOKE_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # small ids exist in every vocabulary; no tokenizer needed


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


class CheckResult(msgspec.Struct, frozen=True):
    name: str
    status: Status
    summary: str
    next_step: str | None = None


class DoctorOptions(msgspec.Struct, frozen=True):
    url: str
    api_key: str | None
    ca_cert: str | None = None
    model: str | None = None
    run_smoke: bool = True


class _Findings:
    """What earlier checks learned that later ones need."""

    def __init__(self) -> None:
        self.reachable = False
        self.info: dict | None = None


# ---------------------------------------------------------------- the checks


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    return str(body.get("detail", body)) if isinstance(body, dict) else str(body)[:200]


def check_reachability(client: httpx.Client, options: DoctorOptions, found: _Findings) -> CheckResult:
    started = time.perf_counter()
    try:
        response = client.get("/api/v1/healthz")
    except httpx.ConnectError as exc:
        if isinstance(exc.__context__, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(exc) or "SSL" in str(exc):
            return CheckResult(
                "reachability", Status.FAIL, f"TLS handshake with {options.url} failed: {exc}",
                "the certificate is not trusted here: pass --ca-cert with the CA that signed it, or fix the "
                "server's certificate chain (the name must match the URL's host)",
            )
        return CheckResult(
            "reachability", Status.FAIL, f"cannot connect to {options.url}: {exc}",
            "check that `openrld serve` runs there (systemctl status openrld, or kubectl get pods -l app=openrld), "
            "that the host and port are right, and that no firewall is in the way",
        )
    except httpx.TimeoutException:
        return CheckResult(
            "reachability", Status.FAIL, f"{options.url} did not answer within {REQUEST_TIMEOUT_S:.0f} s",
            "the host accepts connections but the server does not answer: check the node's load and its log "
            "(journalctl -u openrld, or kubectl logs)",
        )
    elapsed_ms = (time.perf_counter() - started) * 1000
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else None
    if response.status_code != 200 or not isinstance(body, dict) or body.get("status") != "ok":
        return CheckResult(
            "reachability", Status.FAIL,
            f"GET /api/v1/healthz answered {response.status_code}, not an openrld health report",
            "the URL may point at another service or a proxy's error page: use the openrld node's address "
            "(the one `openrld serve` printed)",
        )
    found.reachable = True
    return CheckResult(
        "reachability", Status.OK, f"openrld {body.get('version', '?')} answered in {elapsed_ms:.0f} ms"
    )


def check_tls(client: httpx.Client, options: DoctorOptions, found: _Findings) -> CheckResult:
    parts = urlsplit(options.url)
    if parts.scheme == "https":
        return CheckResult("tls", Status.OK, "HTTPS, certificate verified")
    if is_loopback(parts.hostname or ""):
        return CheckResult("tls", Status.OK, "plain HTTP on loopback (fine: traffic stays on this machine)")
    return CheckResult(
        "tls", Status.WARN, f"plain HTTP to {parts.hostname}: API keys and data cross the network unencrypted",
        "set tls_certfile and tls_keyfile in the node's config (it then serves HTTPS itself), or put TLS in front "
        "of it (an ingress or load balancer with a certificate), and use an https:// URL",
    )


def check_auth(client: httpx.Client, options: DoctorOptions, found: _Findings) -> CheckResult:
    headers = {"X-API-Key": options.api_key} if options.api_key else {}
    response = client.get("/openrl/v1/info", headers=headers)
    if response.status_code == 401:
        given = "the API key given was refused" if options.api_key else "no API key was given"
        return CheckResult(
            "auth", Status.FAIL, f"{given}: {_detail(response)}",
            "pass --api-key (or set TINKER_API_KEY) to a key listed in the node's api_keys_file",
        )
    if response.status_code == 404:
        return CheckResult(
            "auth", Status.FAIL, "the server has no GET /openrl/v1/info (an older openrld, or not openrld)",
            "upgrade the node to an openrld that serves /openrl/v1/info",
        )
    if response.status_code != 200:
        return CheckResult(
            "auth", Status.FAIL, f"GET /openrl/v1/info answered {response.status_code}: {_detail(response)}",
            "read the node's log around this time for the cause",
        )
    found.info = response.json()
    if found.info.get("auth") == "open":
        return CheckResult("auth", Status.OK, "open mode: the node needs no key (it serves loopback only)")
    return CheckResult("auth", Status.OK, "API key accepted")


def check_version(client: httpx.Client, options: DoctorOptions, found: _Findings) -> CheckResult:
    assert found.info is not None
    try:
        installed: str | None = metadata.version("tinker")
    except metadata.PackageNotFoundError:
        installed = None
    return sdk_verdict(installed, found.info)


def sdk_verdict(installed: str | None, info: dict) -> CheckResult:
    """The tinker SDK installed here (None: none is) against the releases a node's /openrl/v1/info says it serves."""
    server = info.get("version")
    releases = info.get("tinker_sdk_releases") or {}
    newest = str(releases.get("newest") or info.get("tinker_sdk_version"))
    oldest = str(releases.get("oldest") or newest)  # a node before the range was stated serves one release
    tested = tuple(releases.get("tested") or (newest,))
    served = f"tinker SDK {oldest} to {newest}" if oldest != newest else f"tinker SDK {newest}"
    if installed is None:
        return CheckResult(
            "version", Status.WARN, f"openrld {server} serves {served}; no tinker SDK is installed here",
            f"pip install tinker=={newest}",
        )
    number, low, high = release(installed), release(oldest), release(newest)
    if number is None or low is None or high is None:
        return CheckResult(
            "version", Status.WARN, f"openrld {server} serves {served}; the tinker installed here is {installed!r}",
            f"pip install tinker=={newest}",
        )
    if number < low:
        return CheckResult(
            "version", Status.WARN,
            f"tinker {installed} is installed here, older than openrld {server} serves ({served})",
            f"pip install 'tinker>={oldest}' (the loop is tested with {', '.join(tested)})",
        )
    if number > high:
        return CheckResult(
            "version", Status.WARN,
            f"tinker {installed} is installed here, newer than openrld {server} was tested with ({served})",
            f"if a call fails, pip install tinker=={newest}",
        )
    how = "one of the releases its tests run" if installed in tested else "within that range"
    return CheckResult(
        "version", Status.OK, f"tinker {installed} is installed here; openrld {server} serves {served} ({how})"
    )


def _describe_devices(devices: list[dict]) -> str:
    if not devices:
        return "no devices reported"
    return ", ".join(f"{d['name']} ({d['memory_bytes'] / 2**30:.1f} GiB)" for d in devices)


def check_cluster(client: httpx.Client, options: DoctorOptions, found: _Findings) -> CheckResult:
    assert found.info is not None
    headers = {"X-API-Key": options.api_key} if options.api_key else {}
    response = client.get("/openrl/v1/cluster", headers=headers)
    devices = _describe_devices(found.info.get("devices", []))
    if response.status_code == 404:
        return CheckResult(
            "cluster", Status.OK,
            f"single node (this server has no cluster API, GET /openrl/v1/cluster, yet); its devices: {devices}",
        )
    if response.status_code != 200:
        return CheckResult(
            "cluster", Status.FAIL, f"GET /openrl/v1/cluster answered {response.status_code}: {_detail(response)}",
            "read the node's log around this time for the cause",
        )
    view = response.json()
    if view.get("is_clustered") is False:
        return CheckResult("cluster", Status.OK, f"single node (no cluster_secret, so in no cluster); its devices: {devices}")
    members = view.get("members", [])
    listed = "; ".join(f"{m.get('name', '?')}: {_describe_devices(m.get('devices', []))}" for m in members)
    plain = [
        m.get("name", "?") for m in members
        if urlsplit(m.get("peer_url", "")).scheme == "http" and not is_loopback(urlsplit(m["peer_url"]).hostname or "")
    ]
    if plain:
        return CheckResult(
            "cluster", Status.WARN,
            f"{len(members)} members: {listed}; peer traffic to {', '.join(plain)} is plain HTTP, so relayed "
            "requests carry API keys across the network unencrypted",
            "set tls_certfile, tls_keyfile and tls_ca_certs on every node of the cluster",
        )
    is_https = all(m.get("peer_url", "").startswith("https://") for m in members)
    peers = "peers over HTTPS" if is_https else "peers over plain HTTP on loopback"
    return CheckResult("cluster", Status.OK, f"{len(members)} members ({peers}): {listed}")


def check_smoke(client: httpx.Client, options: DoctorOptions, found: _Findings) -> CheckResult:
    assert found.info is not None
    models = [m["model_name"] for m in found.info.get("models", [])]
    if options.model is not None and options.model not in models:
        return CheckResult(
            "smoke", Status.FAIL, f"--model {options.model!r} is not served here; served: {', '.join(models) or 'none'}",
            "pick one of the served models, or add it to [models] in the node's openrld.toml",
        )
    if not models:
        return CheckResult(
            "smoke", Status.FAIL, "the server lists no models, so nothing can be trained",
            "add a base model to [models] in the node's openrld.toml and restart it",
        )
    try:
        import tinker
    except ImportError:
        return CheckResult("smoke", Status.SKIP, "the tinker SDK is not installed here", "pip install tinker")
    model = options.model or models[0]
    rank = min(4, int(found.info["limits"]["max_lora_rank"]))
    # Open mode accepts any tml- key; the SDK insists on having one.
    api_key = options.api_key or "tml-openrl-doctor"
    step = "connect"
    started = time.perf_counter()
    try:
        service = tinker.ServiceClient(base_url=options.url, api_key=api_key)
        try:
            step = "create_lora_training_client"
            training = service.create_lora_training_client(base_model=model, rank=rank, seed=0).result(SMOKE_TIMEOUT_S)
            datum = tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(SMOKE_TOKENS[:-1]),
                # The SDK converts a list (Datum.__post_init__) though its annotation names only TensorData.
                loss_fn_inputs={"target_tokens": SMOKE_TOKENS[1:]},  # type: ignore[dict-item]
            )
            step = "forward_backward"
            fb = training.forward_backward([datum], "cross_entropy").result(SMOKE_TIMEOUT_S)
            step = "optim_step"
            training.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result(SMOKE_TIMEOUT_S)
            step = "save_weights_and_get_sampling_client"
            sampler = training.save_weights_and_get_sampling_client().result(SMOKE_TIMEOUT_S)
            step = "sample"
            sampled = sampler.sample(
                tinker.types.ModelInput.from_ints(SMOKE_TOKENS[:4]), num_samples=1,
                sampling_params=tinker.types.SamplingParams(max_tokens=4, temperature=1.0, seed=0),
            ).result(SMOKE_TIMEOUT_S)
        finally:
            service.close("success").result(REQUEST_TIMEOUT_S)
    except Exception as exc:  # any failure of the run is this check's finding, reported with its step
        return CheckResult(
            "smoke", Status.FAIL, f"failed at {step} on {model}: {type(exc).__name__}: {exc}",
            "read the node's log (journalctl -u openrld, or kubectl logs) around this time; "
            "a failure at create_lora_training_client usually means the model's files are missing or too big for the device",
        )
    tokens = len(sampled.sequences[0].tokens) if sampled.sequences else 0
    elapsed = time.perf_counter() - started
    return CheckResult(
        "smoke", Status.OK,
        f"{model}: LoRA rank {rank}, one step (loss {fb.metrics.get('loss:sum', float('nan')):.3f}), "
        f"sampled {tokens} tokens, session closed; {elapsed:.1f} s",
    )


Check = Callable[[httpx.Client, DoctorOptions, _Findings], CheckResult]

# (name, check, what it needs first: "reachable" or "info")
_CHECKS: tuple[tuple[str, Check, str | None], ...] = (
    ("reachability", check_reachability, None),
    ("tls", check_tls, "reachable"),
    ("auth", check_auth, "reachable"),
    ("version", check_version, "info"),
    ("cluster", check_cluster, "info"),
    ("smoke", check_smoke, "info"),
)


def run_checks(options: DoctorOptions) -> list[CheckResult]:
    """Run every check against `options.url`, in order; a check whose prerequisite failed is skipped."""
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=options.ca_cert) if options.ca_cert else True
    found = _Findings()
    results: list[CheckResult] = []
    with httpx.Client(base_url=options.url, timeout=REQUEST_TIMEOUT_S, verify=verify) as client:
        for name, check, needs in _CHECKS:
            if name == "smoke" and not options.run_smoke:
                results.append(CheckResult(name, Status.SKIP, "skipped (--no-smoke)"))
                continue
            if (needs == "reachable" and not found.reachable) or (needs == "info" and found.info is None):
                prerequisite = "the server is unreachable" if not found.reachable else "the auth check failed"
                results.append(CheckResult(name, Status.SKIP, f"skipped: {prerequisite}"))
                continue
            try:
                results.append(check(client, options, found))
            except httpx.HTTPError as exc:
                results.append(
                    CheckResult(name, Status.FAIL, f"{type(exc).__name__}: {exc}", "check the node's log and network")
                )
    return results


def format_report(url: str, results: list[CheckResult]) -> str:
    lines = [f"{PROG} {url}"]
    width = max(len(r.name) for r in results)
    for r in results:
        lines.append(f"  {r.status.value.upper():<4}  {r.name:<{width}}  {r.summary}")
        if r.next_step and r.status in (Status.FAIL, Status.WARN):
            lines.append(f"  {'':<4}  {'':<{width}}  next: {r.next_step}")
    counts = {status: sum(r.status is status for r in results) for status in Status}
    lines.append(
        f"{counts[Status.OK]} ok, {counts[Status.WARN]} warnings, {counts[Status.FAIL]} failed, "
        f"{counts[Status.SKIP]} skipped"
    )
    return "\n".join(lines)


def exit_status(results: list[CheckResult]) -> int:
    return 1 if any(r.status is Status.FAIL for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Check an openrld deployment from this machine.")
    parser.add_argument("--url", required=True, help="the node's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", help="a tml- key (default: $TINKER_API_KEY); open-mode nodes need none")
    parser.add_argument("--ca-cert", help="a PEM file with the CA that signed the server's certificate")
    parser.add_argument("--model", help="the base model for the smoke run (default: the first one served)")
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke run (no training, no sampling)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
        parser.error(f"--url: expected http://HOST:PORT or https://HOST[:PORT], got {args.url!r}")
    if args.ca_cert is not None:
        try:  # read now, so that a wrong path is a usage error rather than a traceback mid-check
            ssl.create_default_context(cafile=args.ca_cert)
        except (OSError, ssl.SSLError) as exc:
            parser.error(f"--ca-cert: cannot read {args.ca_cert!r} as PEM CA certificates: {exc}")
    options = DoctorOptions(
        url=url,
        api_key=args.api_key or os.environ.get("TINKER_API_KEY") or None,  # the SDK's own variable
        ca_cert=args.ca_cert,
        model=args.model,
        run_smoke=not args.no_smoke,
    )
    results = run_checks(options)
    if args.json:
        print(json.dumps({"url": url, "ok": exit_status(results) == 0, "checks": msgspec.to_builtins(results)}))
    else:
        print(format_report(url, results))
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())

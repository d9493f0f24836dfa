"""docs/settings.md and the script that writes it (scripts/settings_doc.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from openrld.settings import settings_json_schema

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "settings_doc.py"

_spec = importlib.util.spec_from_file_location("settings_doc", SCRIPT)
settings_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(settings_doc)


def test_docs_settings_md_is_what_the_script_prints_now():
    # The command docs/settings.md names, run as a reader would: a change to a setting,
    # a config key or its comment in config/openrld.toml fails here until the file is regenerated.
    printed = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, check=True)
    assert printed.stdout == (ROOT / "docs" / "settings.md").read_text()


def test_a_key_takes_the_comment_paragraph_right_above_it():
    text = textwrap.dedent(
        """\
        # Not this one: a blank line ends it.

        # The port,
        # on two lines.
        port = 8000
        """
    )
    assert settings_doc.comment_paragraphs(text) == {"port": "The port, on two lines."}


def test_keys_on_consecutive_lines_share_the_paragraph_above_the_first():
    text = "# A certificate and its key.\n# tls_certfile = \"a.crt\"\n# tls_keyfile = \"a.key\"\n# The CA.\n# tls_ca_certs = \"ca.crt\"\n"
    assert settings_doc.comment_paragraphs(text) == {
        "tls_certfile": "A certificate and its key.",
        "tls_keyfile": "A certificate and its key.",
        "tls_ca_certs": "The CA.",
    }


def test_a_table_takes_the_paragraph_above_its_header_and_names_its_keys_by_it():
    text = "# --- Deadlines.\n[http]\n# For a head.\nhead_timeout = 10.0\n"
    assert settings_doc.comment_paragraphs(text) == {"http": "Deadlines.", "http.head_timeout": "For a head."}


def test_a_key_without_a_comment_above_it_is_left_unexplained():
    assert settings_doc.comment_paragraphs("# Heading.\n\nport = 8000\n") == {}


def test_a_node_config_key_the_shipped_file_does_not_explain_is_an_error_naming_it():
    meanings = settings_doc.comment_paragraphs(settings_doc.SHIPPED_CONFIG.read_text())
    del meanings["longpoll_s"]
    with pytest.raises(settings_doc.UnexplainedKey, match=r"^longpoll_s: no comment above it in openrld.toml"):
        settings_doc.node_config_section(meanings)


def test_a_job_setting_shows_the_values_and_default_of_the_served_schema():
    lines = settings_doc.job_settings_section(settings_json_schema())
    start = lines.index("### `openrl.trainer_gpus`")
    assert lines[start : start + 6] == [
        "### `openrl.trainer_gpus`",
        "",
        "Devices for one trainer; more than 1 needs automodel or an image; more than the largest node has "
        "spans several nodes (automodel).",
        "",
        "- Values: an integer from 1 to 64",
        "- Default: `1`",
    ]


def test_a_node_config_key_shows_its_type_default_environment_variable_and_meaning():
    meanings = settings_doc.comment_paragraphs(settings_doc.SHIPPED_CONFIG.read_text())
    lines = settings_doc.node_config_section(meanings)
    start = lines.index("### `longpoll_s`")
    assert lines[start : start + 7] == [
        "### `longpoll_s`",
        "",
        "- Type: number, > 0 and < 45",
        "- Default: `30.0`",
        "- Environment: `OPENRLD_LONGPOLL_S`",
        "",
        "Longest a retrieve_future poll is held before answering try_again: under the SDK's 45 s request "
        "timeout, so a slow result never looks like a dead server.",
    ]

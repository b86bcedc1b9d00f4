"""Environment switches: parsing, validation errors that name the variable, and re-parsing when they change."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qsa_aiter.runtime import registries, settings
from qsa_aiter.runtime.settings import ENV_NAMES, environment_table, get_settings

BOOL_VARS = {"ATOM_QSA_STACKED_DECODE_SCORER": "stacked_decode_scorer", "QSA_AITER_STRICT": "strict",
             "QSA_AITER_E4M3_MMA": "e4m3_mma", "ROCM_QSA_FLYDSL": "rocm_qsa_flydsl", "QSA_AITER_REBUILD": "rebuild",
             "QSA_AITER_TOPK_PDL": "topk_pdl"}
TRUE_WORDS = ["1", "true", "yes", "on", "TRUE", "Yes", "ON", " 1 "]
FALSE_WORDS = ["0", "false", "no", "off", "FALSE", "No", "Off", "0 "]


def test_defaults():
    s = get_settings()
    assert s.stacked_decode_scorer is True
    assert s.backend == "auto"
    assert s.strict is False
    assert s.e4m3_mma is True
    assert s.tuned_config == ()
    assert s.log_level == "warning"
    assert s.jit_dir == "" and s.rebuild is False
    assert s.logits_workspace_mb == 0
    assert s.topk_pdl is False
    assert s.select_backend == "auto"


def test_every_variable_is_known():
    assert set(ENV_NAMES) == {"ATOM_QSA_STACKED_DECODE_SCORER", "QSA_AITER_BACKEND", "QSA_AITER_STRICT",
                              "QSA_AITER_E4M3_MMA", "QSA_AITER_TUNED_CONFIG", "QSA_AITER_LOG_LEVEL", "ROCM_QSA_FLYDSL",
                              "QSA_AITER_JIT_DIR", "QSA_AITER_REBUILD", "QSA_AITER_TOPK_BACKEND",
                              "QSA_AITER_LOGITS_WORKSPACE_MB", "QSA_AITER_TOPK_PDL", "QSA_AITER_HIP_CLANG",
                              "QSA_AITER_HIP_SDK", "QSA_AITER_SELECT_BACKEND"}


@pytest.mark.parametrize("var", BOOL_VARS)
@pytest.mark.parametrize("word", TRUE_WORDS + FALSE_WORDS)
def test_boolean_words(monkeypatch, var, word):
    monkeypatch.setenv(var, word)
    assert getattr(get_settings(), BOOL_VARS[var]) is (word in TRUE_WORDS)


@pytest.mark.parametrize("var", BOOL_VARS)
@pytest.mark.parametrize("word", ["maybe", "2", "", "-1", "enabled", "t", "y"])
def test_bad_boolean_names_variable_value_and_allowed_words(monkeypatch, var, word):
    monkeypatch.setenv(var, word)
    with pytest.raises(ValueError) as info:
        get_settings()
    message = str(info.value)
    assert var in message and repr(word) in message
    allowed = message.split("allowed:", 1)[1]
    for w in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        assert w in allowed.split(" ")[1].split("/"), message


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("AUTO", "auto")]
                         + [(n, n) for n in registries.SCORING.candidates] + [(" Tiled ", "tiled"), ("ROWWISE", "rowwise")])
def test_backend_values(monkeypatch, value, expected):
    monkeypatch.setenv("QSA_AITER_BACKEND", value)
    assert get_settings().backend == expected


@pytest.mark.parametrize("value,expected", [("auto", "auto"), (" Composite ", "composite")]
                         + [(n.upper(), n) for n in registries.SELECTION.candidates])
def test_select_backend_values(monkeypatch, value, expected):
    monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", value)
    assert get_settings().select_backend == expected
    assert registries.SELECTION.forced(get_settings()) == (None if expected == "auto" else expected)


@pytest.mark.parametrize("value", ["fused", "", "k1", "composite,flydsl_k1"])
def test_bad_select_backend(monkeypatch, value):
    """Like QSA_AITER_BACKEND: a name that is no selection candidate is refused at the first selection decision,
    one that is no name at all when the settings are read; both name the variable and the allowed values."""
    monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", value)
    with pytest.raises(settings.ConfigurationError) as info:
        registries.SELECTION.forced(get_settings())
    message = str(info.value)
    assert f"QSA_AITER_SELECT_BACKEND={value.lower()!r}" in message or f"QSA_AITER_SELECT_BACKEND={value!r}" in message
    assert "allowed: auto" in message


@pytest.mark.parametrize("value", ["cutlass", "", "hip", "rowwise,tiled", "default"])
def test_bad_backend(monkeypatch, value):
    """A name that is no candidate is a configuration error at the first scoring call (the registry knows the
    names); one that is no name at all already when the settings are read."""
    from qsa_aiter.kernels.scoring.base import example_problem

    monkeypatch.setenv("QSA_AITER_BACKEND", value)
    with pytest.raises(ValueError) as info:
        registries.SCORING.select(example_problem(device_type="cpu"))
    message = str(info.value)
    assert "QSA_AITER_BACKEND" in message and repr(value) in message
    assert "allowed: auto" in message


@pytest.mark.parametrize("value,expected", [("debug", "debug"), ("INFO", "info"), ("Warning", "warning"),
                                            ("error", "error")])
def test_log_levels(monkeypatch, value, expected):
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", value)
    assert get_settings().log_level == expected


@pytest.mark.parametrize("value", ["verbose", "critical", "", "20"])
def test_bad_log_level(monkeypatch, value):
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", value)
    with pytest.raises(ValueError) as info:
        get_settings()
    assert "QSA_AITER_LOG_LEVEL" in str(info.value) and repr(value) in str(info.value)


def test_several_bad_values_are_all_reported(monkeypatch):
    monkeypatch.setenv("QSA_AITER_STRICT", "sometimes")
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", "loud")
    with pytest.raises(ValueError) as info:
        get_settings()
    assert "QSA_AITER_STRICT" in str(info.value) and "QSA_AITER_LOG_LEVEL" in str(info.value)


def test_reparsed_when_the_environment_changes(monkeypatch):
    first = get_settings()
    assert get_settings() is first, "unchanged environment: the parsed settings are reused"
    monkeypatch.setenv("QSA_AITER_STRICT", "1")
    assert get_settings().strict is True
    monkeypatch.setenv("QSA_AITER_STRICT", "0")
    assert get_settings().strict is False
    monkeypatch.setenv("QSA_AITER_STRICT", "bogus")
    with pytest.raises(ValueError):
        get_settings()
    with pytest.raises(ValueError):
        get_settings()  # a bad value is never cached as a default
    monkeypatch.delenv("QSA_AITER_STRICT")
    assert get_settings().strict is False


@pytest.mark.parametrize("how", ["os.environ", "patch.dict", "clear", "alias"])
def test_every_way_of_changing_the_environment_is_seen(monkeypatch, how):
    """The snapshot reads ``os.environ``'s own storage: writes through ``os.environ`` of every kind reach it."""
    import os
    from unittest import mock

    monkeypatch.delenv("QSA_AITER_STRICT", raising=False)
    assert get_settings().strict is False
    if how == "os.environ":
        os.environ["QSA_AITER_STRICT"] = "1"
        try:
            assert get_settings().strict is True
        finally:
            del os.environ["QSA_AITER_STRICT"]
    elif how == "patch.dict":
        with mock.patch.dict(os.environ, {"QSA_AITER_STRICT": "1"}):
            assert get_settings().strict is True
    elif how == "clear":
        monkeypatch.setenv("QSA_AITER_STRICT", "1")
        assert get_settings().strict is True
        with mock.patch.dict(os.environ, {}, clear=True):
            assert get_settings().strict is False
    else:
        for alias, name in settings.ENV_ALIASES.items():  # a variable's other names are watched too
            field = next(f for f, info in settings.QsaSettings.model_fields.items() if info.alias == name)
            before = getattr(get_settings(), field)
            with mock.patch.dict(os.environ, {alias: "0" if before else "1"}):
                monkeypatch.setattr(settings, "_cache", None)  # the warning comes when the variables are parsed
                if alias in settings.FORMER_NAMES:
                    with pytest.warns(FutureWarning, match=alias):
                        assert getattr(get_settings(), field) is not before
                else:
                    assert getattr(get_settings(), field) is not before
    assert get_settings().strict is (how == "clear")


def test_former_names_are_aliases_of_the_current_names():
    for former, name in settings.FORMER_NAMES.items():
        assert settings.ENV_ALIASES[former] == name and name in ENV_NAMES


@pytest.mark.parametrize("word,expected", [("0", False), ("off", False), ("1", True), ("yes", True)])
def test_a_former_name_is_read_as_the_current_one_with_a_warning(monkeypatch, word, expected):
    """``QSA_AITER_FP8_MMA``, the former name of ``QSA_AITER_E4M3_MMA``, still switches the e4m3 MMA path, and a
    ``FutureWarning`` names both variables."""
    monkeypatch.setattr(settings, "_cache", None)  # the warning comes when the variables are parsed
    monkeypatch.setenv("QSA_AITER_FP8_MMA", word)
    with pytest.warns(FutureWarning) as record:
        assert get_settings().e4m3_mma is expected
    message = str(record[0].message)
    assert "QSA_AITER_FP8_MMA" in message and "set QSA_AITER_E4M3_MMA instead" in message


def test_the_current_name_reads_without_a_warning(monkeypatch):
    import warnings

    monkeypatch.setattr(settings, "_cache", None)
    monkeypatch.setenv("QSA_AITER_E4M3_MMA", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_settings().e4m3_mma is False


@pytest.mark.parametrize("current,former,agree", [("1", "on", True), ("0", "no", True), ("1", "0", False),
                                                   ("off", "true", False)])
def test_a_former_name_set_beside_the_current_one_must_agree(monkeypatch, current, former, agree):
    monkeypatch.setattr(settings, "_cache", None)
    monkeypatch.setenv("QSA_AITER_E4M3_MMA", current)
    monkeypatch.setenv("QSA_AITER_FP8_MMA", former)
    if agree:
        with pytest.warns(FutureWarning):
            assert get_settings().e4m3_mma is (current in TRUE_WORDS)
        return
    with pytest.raises(ValueError) as info:
        get_settings()
    message = str(info.value)
    assert f"QSA_AITER_E4M3_MMA={current!r}" in message and f"QSA_AITER_FP8_MMA={former!r}" in message
    assert "disagree" in message


def test_a_bad_value_under_a_former_name_names_that_name(monkeypatch):
    monkeypatch.setenv("QSA_AITER_FP8_MMA", "maybe")
    with pytest.warns(FutureWarning), pytest.raises(ValueError) as info:
        get_settings()
    assert "environment variable QSA_AITER_FP8_MMA='maybe' is invalid" in str(info.value)


def test_the_snapshot_falls_back_to_environ_get_without_its_storage(monkeypatch):
    class Plain(dict):  # an environ without ``_data`` and ``encodekey``
        pass

    monkeypatch.setattr(settings.os, "environ", Plain(QSA_AITER_STRICT="1"))
    snapshot = settings._environment_snapshot()
    assert snapshot()[settings.ENV_VARIABLES.index("QSA_AITER_STRICT")] == "1"


def test_unrelated_variables_are_ignored(monkeypatch):
    monkeypatch.setattr(settings, "_cache", None)  # parse now, whatever earlier tests left cached
    monkeypatch.setenv("QSA_AITER_SOMETHING_ELSE", "x")
    monkeypatch.setenv("stacked_decode_scorer", "0")  # field names are not variable names
    assert get_settings().stacked_decode_scorer is True


def test_settings_are_frozen():
    with pytest.raises(ValidationError):
        get_settings().strict = True


def test_environment_table_lists_every_variable():
    table = environment_table()
    for name in ENV_NAMES:
        assert f"`{name}`" in table
    assert "| `ATOM_QSA_STACKED_DECODE_SCORER` | `1` |" in table
    assert "| `QSA_AITER_BACKEND` | `auto` |" in table
    assert "| `QSA_AITER_E4M3_MMA` (formerly `QSA_AITER_FP8_MMA`) | `1` |" in table
    assert table.count("\n") == len(ENV_NAMES) + 1


def test_bool_words_constant():
    assert set(settings.BOOL_WORDS) == {"0", "1", "true", "false", "yes", "no", "on", "off"}


def test_lower_case_variable_names_are_not_read(monkeypatch):
    monkeypatch.setattr(settings, "_cache", None)  # whatever earlier tests parsed
    monkeypatch.setenv("qsa_aiter_strict", "1")
    assert get_settings().strict is False


@pytest.mark.parametrize("value,expected", [("0", 0), ("128", 128), (" 2048 ", 2048), ("007", 7)])
def test_logits_workspace_mebibytes(monkeypatch, value, expected):
    monkeypatch.setenv("QSA_AITER_LOGITS_WORKSPACE_MB", value)
    assert get_settings().logits_workspace_mb == expected


@pytest.mark.parametrize("value", ["-1", "+5", "1.5", "1e3", "64MB", "", "  ", "auto", "\u0661\u0662"])
def test_bad_logits_workspace_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("QSA_AITER_LOGITS_WORKSPACE_MB", value)
    with pytest.raises(settings.ConfigurationError) as info:
        get_settings()
    message = str(info.value)
    assert message.startswith(f"environment variable QSA_AITER_LOGITS_WORKSPACE_MB={value!r} is invalid: allowed: 0")
    assert "whole number of MiB" in message


def test_tuned_config_paths_split_on_colons(monkeypatch):
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", "/a/x.csv:/b/y.csv:")
    assert get_settings().tuned_config == ("/a/x.csv", "/b/y.csv")


def test_the_documented_table_is_current():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "environment_variables.md").read_text()
    assert environment_table() in doc, "regenerate the table in docs/environment_variables.md"

"""fp4jax.xla_flags: the one reader of XLA_FLAGS, and the modules that ask it (gemm_errors' capture)."""

import pytest

from fp4jax import gemm_errors, xla_flags

FLAG = "--xla_gpu_deterministic_ops"


@pytest.mark.parametrize(
    "xla_flags_env, values, boolean",
    [
        ("", [], None),
        ("--xla_dump_to=/tmp/d", [], None),
        (f"{FLAG}=true", ["true"], True),
        (f"{FLAG}", [""], True),  # bare: XLA reads a bare boolean flag as true
        (f"{FLAG}=TRUE --xla_dump_to=/tmp/d", ["TRUE"], True),
        (f"{FLAG}=1", ["1"], True),
        (f"{FLAG}=false", ["false"], False),
        (f"{FLAG}=true {FLAG}=0", ["true", "0"], False),  # the last one counts
        (f"{FLAG}_other=true", [], None),  # another flag with the same prefix
        (f"--xla_other {FLAG}-x=true", [], None),
    ],
)
def test_values_and_boolean(monkeypatch, xla_flags_env, values, boolean):
    monkeypatch.setenv("XLA_FLAGS", xla_flags_env)
    assert xla_flags.values(FLAG) == values
    assert xla_flags.boolean(FLAG) is boolean


def test_a_value_xla_cannot_read_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=yes")
    with pytest.raises(ValueError, match=f"XLA_FLAGS sets {FLAG}=yes; write {FLAG}=true or {FLAG}=false"):
        xla_flags.boolean(FLAG)


def test_no_xla_flags_at_all(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert xla_flags.values(FLAG) == [] and xla_flags.boolean(FLAG) is None


@pytest.mark.parametrize(
    "xla_flags_env, option, expected",
    [
        (f"{FLAG}=true", "auto", "xla"),
        (f"{FLAG}", "cudnn", "xla"),  # bare flag: on, as XLA reads it (the old substring check missed it)
        (f"{FLAG}=false", "cudnn", "cudnn"),
        (f"{FLAG}=true {FLAG}=false", "auto", "auto"),
        (f"{FLAG}_other=true", "cudnn", "cudnn"),
        (f"{FLAG}=true", "xla", "xla"),
        ("", "auto", "auto"),
    ],
)
def test_capture_takes_xla_attention_under_deterministic_ops(monkeypatch, xla_flags_env, option, expected):
    monkeypatch.setenv("XLA_FLAGS", xla_flags_env)
    assert gemm_errors._capture_attention(option) == expected


def test_the_trainer_reports_an_unreadable_flag_as_a_config_error(monkeypatch):
    from tiny_runs import tiny_config

    from fp4jax.training import setup
    from fp4jax.training.errors import ConfigError

    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=yes")
    with pytest.raises(ConfigError, match=f"XLA_FLAGS sets {FLAG}=yes"):
        setup.resolve_config(tiny_config("unused"))

"""yamlsrc.load: a file UTF-8 or YAML refuses, an alias loop or a billion-laughs expansion, and a key YAML would
change are each one ConfigError naming file:line (never a UnicodeDecodeError, ReaderError or RecursionError, never a
hang); numbers are finite."""

from __future__ import annotations

import time

import pytest

from dflash_ops.errors import ConfigError
from dflash_ops.yamlsrc import Fields, load


def _fails(tmp_path, data: bytes | str) -> str:
    p = tmp_path / "f.yaml"
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(ConfigError) as exc:
        load(p)
    assert "\n" not in exc.value.message
    return exc.value.message.replace(str(p), "F")


def test_bytes_that_are_not_utf8_name_their_line(tmp_path):
    assert _fails(tmp_path, b"a: 1\nb: \xff\n") == "F:2: not UTF-8 text (byte 0xff)"


def test_a_character_yaml_refuses_names_its_line(tmp_path):
    assert _fails(tmp_path, 'a: 1\nb: "\x07"\n') == "F:2: malformed YAML: character U+0007 is not allowed"


@pytest.mark.parametrize("text, line", [
    ("x: &a [*a]\n", 1),                          # a RecursionError before
    ("x: &a {k: [1, *a]}\n", 1),
    ("a: 1\nb: &b\n  - c: &c {d: *b}\n", 2),     # the line of the anchor
])
def test_an_alias_inside_the_value_it_names_is_a_loop(tmp_path, text, line):
    assert _fails(tmp_path, text) == f"F:{line}: the value anchored here contains an alias of itself (a loop)"


def test_a_billion_laughs_file_is_refused_at_once(tmp_path):
    """Each level aliases the one before nine times: 9**10 values expanded, which hung before."""
    text = 'l0: &l0 ["ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha", "ha"]\n'
    text += "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
    t0 = time.monotonic()
    assert "more than 100000 values once YAML aliases are expanded" in _fails(tmp_path, text)
    assert time.monotonic() - t0 < 10


def test_aliases_of_shared_values_work_as_pyyaml_writes_them(tmp_path):
    """safe_dump writes `&id001` / `*id001` for a value used twice (a generated inventory has them)."""
    import yaml

    shared = {"containers": {200: {}}, "transport": "proxmox"}
    p = tmp_path / "f.yaml"
    p.write_text(yaml.safe_dump({"hosts": {"a": shared, "b": shared}}))
    assert "*id001" in p.read_text()
    assert load(p).plain() == {"hosts": {"a": shared, "b": shared}}


def test_nesting_too_deep_to_recurse_is_a_config_error(tmp_path):
    assert _fails(tmp_path, "a: " + "[" * 5000 + "]" * 5000 + "\n") == "F: malformed YAML: nested too deeply"


@pytest.mark.parametrize("key, reads", [("0200", "128"), ("0x10", "16"), ("2:00", "120"), ("+200", "200"),
                                        ("1_000", "1000"), ("yes", "True"), ("null", "None"), ("~", "None")])
def test_a_key_yaml_would_change_is_refused(tmp_path, key, reads):
    assert _fails(tmp_path, f"a: 1\n{key}: {{}}\n") == (f"F:2: key {key!r} reads as {reads} in YAML: quote it, or "
                                                         "write it as it reads")


@pytest.mark.parametrize("value, reads", [("0022", "18"), ("1_000", "1000"), ("2:00", "120"), ("+5", "5")])
def test_a_number_yaml_would_change_is_refused(tmp_path, value, reads):
    """`port: 0022` is octal 18 in YAML 1.1: a user means 22, so such a value is refused, not read as another."""
    assert _fails(tmp_path, f"a: 1\nport: {value}\n") == (f"F:2: {value!r} reads as {reads} in YAML: quote it, or "
                                                            "write it as it reads")


def test_keys_written_as_they_read_or_quoted_are_kept(tmp_path):
    p = tmp_path / "f.yaml"
    p.write_text("200: a\n'0200': b\n\"yes\": c\n1.5: d\nname: e\n")
    assert load(p).plain() == {200: "a", "0200": "b", "yes": "c", 1.5: "d", "name": "e"}


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", ".NaN", "1" + "0" * 400, "-1", "true", "'3'"])
def test_numbers_are_finite_and_non_negative(tmp_path, value):
    p = tmp_path / "f.yaml"
    p.write_text(f"n: {value}\n")
    with pytest.raises(ConfigError, match=r":1: x: 'n' must be a non-negative number$"):
        Fields.of(load(p), "x").number("n")


def test_positive_and_bounded_numbers(tmp_path):
    p = tmp_path / "f.yaml"
    p.write_text("zero: 0\nbig: 1.0e+12\nok: 2.5\n")
    f = Fields.of(load(p), "x")
    assert f.number("zero") == 0.0 and f.number("ok", positive=True, most=10) == 2.5
    with pytest.raises(ConfigError, match=r":1: x: 'zero' must be a positive number$"):
        f.number("zero", positive=True)
    with pytest.raises(ConfigError, match=r":2: x: 'big' must be a positive number up to 100$"):
        f.number("big", positive=True, most=100)

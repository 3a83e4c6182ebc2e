"""Sizes as people write them parse to exact bytes; anything else is refused with the accepted forms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.memory.sizes import UNITS, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("1.5 GiB", 3 * 2**29),
        ("500MB", 500 * 10**6),
        ("2 TB", 2 * 10**12),
        ("3KiB", 3 * 1024),
        ("1 TiB", 2**40),
        ("7 KB", 7000),
        ("4096", 4096),
        ("4096 B", 4096),
        ("0.5 KiB", 512),
        ("1e3 B", 1000),
    ],
)
def test_binary_and_decimal_units_give_exact_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["24gib", "24GIB", " 24 GiB ", "24\tGiB", "24 gIb"])
def test_unit_case_and_spaces_do_not_matter(text: str) -> None:
    assert parse_bytes(text) == 24 * 2**30


def test_numbers_are_bytes_and_whole_strings_stay_exact_beyond_float_precision() -> None:
    assert parse_bytes(4096) == 4096
    assert parse_bytes(1.5e9) == 1_500_000_000
    assert parse_bytes(10.9) == 10  # rounded down: a limit never grows
    assert parse_bytes(f"{2**60 + 1} B") == 2**60 + 1  # float(2**60 + 1) would lose the 1


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "not a number followed by a unit"),
        ("GiB", "not a number followed by a unit"),
        ("24 GiB GiB", "not a number followed by a unit"),
        ("1,5 GiB", "not a number followed by a unit"),
        ("24 G", "unknown unit 'G'"),
        ("24 gigabytes", "unknown unit 'gigabytes'"),
        ("-1GiB", "not above 0"),
        ("0", "not above 0"),
        ("0 GiB", "not above 0"),
        (0, "not above 0"),
        (-4096, "not above 0"),
        (-1.5, "not above 0"),
        (0.5, "below 1 byte"),
        ("0.1 B", "below 1 byte"),
        (True, "a bool"),
        (False, "a bool"),
        (math.nan, "not finite"),
        (math.inf, "not finite"),
        ("1e999 GiB", "not finite"),
        (None, "a NoneType"),
        ([24], "a list"),
    ],
)
def test_bad_sizes_are_refused_naming_the_accepted_forms(value: object, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value)  # type: ignore[arg-type]
    message = str(info.value)
    assert why in message
    for form in ("KB", "GB", "KiB", "GiB", "'24GiB'", "'1.5 GiB'"):
        assert form in message


@settings(max_examples=200, deadline=None)
@given(
    number=st.floats(min_value=1.0, max_value=1e6, allow_nan=False, allow_infinity=False),
    unit=st.sampled_from(sorted(UNITS)),
)
def test_a_decimal_size_is_its_number_times_its_unit_rounded_down(number: float, unit: str) -> None:
    text = f"{number!r} {unit.upper()}"
    assert parse_bytes(text) == math.floor(float(repr(number)) * UNITS[unit])


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (3 * 2**29, "1.50 GiB"),
        (5 * 2**20, "5.00 MiB"),
        (2**41, "2.00 TiB"),
        (-(2**20), "-1.00 MiB"),
    ],
)
def test_format_bytes_uses_the_largest_binary_unit_reached(nbytes: int, text: str) -> None:
    assert format_bytes(nbytes) == text


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=2**50))
def test_a_formatted_size_parses_back_within_its_rounding(nbytes: int) -> None:
    back = parse_bytes(format_bytes(nbytes))
    assert abs(back - nbytes) <= 0.005 * nbytes + 1

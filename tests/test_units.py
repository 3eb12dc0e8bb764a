"""Byte quantities (osdp_fx/units.py): what a user may write for a memory limit, and how bytes
are printed."""

from __future__ import annotations

import pytest

from osdp_fx.errors import InputError
from osdp_fx.units import format_bytes, parse_bytes


@pytest.mark.parametrize(("value", "expected"), [
    (0, 0), (1 << 30, 1 << 30), (1536.9, 1536), ("8GiB", 8 * 2**30), ("512 MB", 512 * 10**6),
    ("1.5 GiB", 3 * 2**29), (" 16gb ", 16 * 10**9), ("2tib", 2 * 2**40), ("100", 100),
    ("100B", 100), (".5KiB", 512),
])
def test_accepted_quantities(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(("value", "message"), [
    (True, "must be bytes \\(int\\) or a string like '8GiB', got True"),
    (-1, "finite, non-negative number of bytes.*got -1"),
    (float("nan"), "got nan"),
    (float("inf"), "got inf"),
    ("8 gigs", "'8 gigs' is not a byte quantity.*units: b, kb, mb, gb, tb, kib, mib, gib, tib"),
    ("GiB", "'GiB' is not a byte quantity"),
    ("-1GiB", "'-1GiB' is not a byte quantity"),
    (None, "None is not a byte quantity"),
])
def test_refused_quantities_name_the_accepted_forms(value, message):
    with pytest.raises(InputError, match=message):
        parse_bytes(value)
    with pytest.raises(InputError, match="^gather bucket"):
        parse_bytes(value, what="gather bucket")


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
    (2**30 * 80, "80.0 GiB"), (2**40 * 5000, "5000.0 TiB"), (-2048, "-2.0 KiB"),
])
def test_format_bytes_uses_binary_units(n, text):
    assert format_bytes(n) == text

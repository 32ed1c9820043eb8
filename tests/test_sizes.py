import pytest

from autoplan.errors import UsageError
from autoplan.sizes import format_bytes, parse_mem_bytes


@pytest.mark.parametrize("text, expected", [
    ("8GB", 8 * 10**9), ("8GiB", 8 * 2**30), ("8000MB", 8 * 10**9), ("8e9", 8 * 10**9),
    ("1.5 GB", 1_500_000_000), ("512mib", 512 * 2**20), ("80GiB", 80 * 2**30), (4096, 4096),
])
def test_accepted_sizes(text, expected):
    assert parse_mem_bytes(text) == expected


@pytest.mark.parametrize("text", ["abc", "-1GB", "0", "0GB", "8XB", "", "GB", "nan", "inf"])
def test_refused_sizes_say_what_is_accepted(text):
    with pytest.raises(UsageError, match="8GB .*8GiB"):
        parse_mem_bytes(text)


def test_format_bytes_uses_decimal_units():
    assert format_bytes(8e9) == "8.00 GB"
    assert format_bytes(512) == "512 B"

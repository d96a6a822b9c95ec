import pytest

from cardfit.errors import CardfitError
from cardfit.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text,value", [
    ("24GiB", 24 * 2**30), ("6GB", 6 * 10**9), ("512MiB", 512 * 2**20), ("1.5 GiB", 3 * 2**29),
    ("123", 123), ("2g", 2 * 2**30), ("10MB", 10**7), (4096, 4096),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["12xB", "GiB", "", "-5GiB", "1e999GB", "nan", "five"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(CardfitError):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * 2**30 + 2**29) == "3.50 GiB"
    assert format_bytes(24.23 * 2**20) == "24.23 MiB"
    assert format_bytes(-2**30) == "-1.00 GiB"

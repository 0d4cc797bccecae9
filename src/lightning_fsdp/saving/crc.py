"""CRC-32 (the zip and zlib checksum) of a record whose bytes are written by several ranks, each knowing only its own.

A CRC-32 is an affine function over GF(2) of a message of fixed length: appending ``n`` zero bytes to a message
multiplies its register (the CRC with the final inversion undone) by ``x^(8n)`` modulo the CRC polynomial. So the
CRC of ``A || B`` follows from the CRCs of ``A`` and ``B`` and the length of ``B`` (:func:`crc32_combine`), and the CRC
of a record follows from one value per rank: each rank computes the CRC of the record as it would be if every byte it
does not write were zero (:class:`SparseCrc`), and the XOR of those values over all ranks, corrected by the CRC of an
all-zero record of the same length when the number of ranks is even, is the record's CRC (:func:`combine_sparse`).

Polynomials are kept in the reflected bit order that zlib uses: bit 31 is the coefficient of ``x^0``.
"""

import zlib

_POLY = 0xEDB88320
"""The CRC-32 polynomial, reflected (``x^32`` implied)."""
_ONE = 1 << 31
"""The polynomial ``1`` in reflected order."""
_ALL_ONES = 0xFFFFFFFF
#: Zero gaps up to this many bytes are hashed as zeros (C speed); longer ones by a multiplication (about 1,000 Python
#: operations, whatever the length).
_ZERO_FEED_MAX = 1 << 20
_ZEROS = bytes(_ZERO_FEED_MAX)


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial, both reflected."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for ``k`` from 0 to 63, reflected."""
    powers = [_ONE >> 1]  # x^1
    for _ in range(63):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_POW_2K = _powers()


def _x_to_8n(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial, reflected."""
    result = _ONE
    exponent = 8 * nbytes
    k = 0
    while exponent:
        if exponent & 1:
            result = _multiply(_X_POW_2K[k], result)
        exponent >>= 1
        k += 1
    return result


def shift(register: int, nbytes: int) -> int:
    """``register`` (a CRC without its final inversion, or any linear part) after ``nbytes`` zero bytes."""
    return _multiply(_x_to_8n(nbytes), register) if nbytes else register


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32 of ``A || B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return shift(crc_a, length_b) ^ crc_b


def crc32_zeros(nbytes: int) -> int:
    """The CRC-32 of ``nbytes`` zero bytes."""
    return shift(_ALL_ONES, nbytes) ^ _ALL_ONES


def extend_with_zeros(crc: int, nbytes: int) -> int:
    """The CRC-32 of a message of CRC ``crc`` followed by ``nbytes`` zero bytes."""
    if nbytes <= _ZERO_FEED_MAX:
        return zlib.crc32(_ZEROS[:nbytes], crc)
    return shift(crc ^ _ALL_ONES, nbytes) ^ _ALL_ONES


class SparseCrc:
    """The CRC-32 of a record of ``length`` bytes in which only the runs this rank adds are non-zero.

    Runs must be added in ascending order of their offsets and must not overlap.

    """

    def __init__(self, length: int) -> None:
        self.length = length
        self._crc = 0
        self._position = 0

    def add(self, offset: int, data: object) -> None:
        """Add the bytes ``data`` (any object with the buffer protocol) that start at ``offset`` of the record."""
        if offset < self._position:
            raise ValueError(f"runs must ascend and not overlap: {offset} < {self._position}")
        self._crc = zlib.crc32(data, extend_with_zeros(self._crc, offset - self._position))  # type: ignore[arg-type]
        self._position = offset + memoryview(data).nbytes  # type: ignore[arg-type]

    def value(self) -> int:
        """The CRC of the whole record, with zeros after the last run."""
        if self._position > self.length:
            raise ValueError(f"the runs end at byte {self._position}, past the record's {self.length} bytes")
        return extend_with_zeros(self._crc, self.length - self._position)


def combine_sparse(values: list[int], length: int) -> int:
    """The CRC-32 of a record from every rank's :meth:`SparseCrc.value` (one per rank, each byte written by one rank).

    ``crc(M) = Lin(M) ^ crc(zeros)`` with ``Lin`` linear, and ``M`` is the XOR of the ranks' sparse records, so
    ``crc(M)`` is the XOR of the ranks' values with ``crc(zeros)`` XOR-ed in once more per rank, minus one.

    """
    combined = 0
    for value in values:
        combined ^= value
    if len(values) % 2 == 0:
        combined ^= crc32_zeros(length)
    return combined

# Types of the Cython module fastio._memops (see _memops.pyx for what each function does).
from collections.abc import Sequence
from typing import Literal, overload

import numpy as np
from typing_extensions import Buffer

# Any C-contiguous buffer; numpy arrays are listed because numpy's stubs declare no buffer
# protocol before Python 3.12.
_Data = Buffer | np.ndarray

def crc32c(data: _Data, value: int = 0) -> int: ...
def crc32c_software(data: _Data, value: int = 0) -> int: ...
def crc32c_backend() -> str: ...
@overload
def copy_regions(dst_addresses: Sequence[int], src_addresses: Sequence[int], sizes: Sequence[int],
                 checksums: Literal[False] = False) -> int: ...
@overload
def copy_regions(dst_addresses: Sequence[int], src_addresses: Sequence[int], sizes: Sequence[int],
                 checksums: Literal[True]) -> list[int]: ...
@overload
def copy_regions(dst_addresses: Sequence[int], src_addresses: Sequence[int], sizes: Sequence[int],
                 checksums: bool) -> int | list[int]: ...

# Types of the Cython module lowdiff.format._deltas (see _deltas.pyx).
from collections.abc import Sequence

import numpy as np

def encode_deltas(indices: np.ndarray, counts: Sequence[int]) -> tuple[bytearray | memoryview, list[int]]: ...
def decode_deltas(data: bytes | bytearray | memoryview, offset: int, nnz: int, width: int,
                  numel: int) -> np.ndarray | None: ...

# Types of the Cython module lowdiff.format._deltas (see _deltas.pyx).
from collections.abc import Sequence

import numpy as np

def encode_deltas(indices: np.ndarray, counts: Sequence[int]) -> tuple[bytearray | memoryview, list[int]]: ...
def decode_deltas_many(data: bytes | bytearray | memoryview, offset: int, nnzs: np.ndarray, widths: np.ndarray,
                       numels: np.ndarray) -> tuple[np.ndarray | None, int]: ...
def flat_positions(sparse_indices: np.ndarray, counts: np.ndarray, offsets: np.ndarray,
                   dense: np.ndarray) -> np.ndarray: ...

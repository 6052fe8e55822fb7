"""fastio: the I/O engine of lowdiff (io_uring with O_DIRECT, or a pwrite thread pool)."""
from ._config import ALIGN_BYTES, FastioConfig
from ._engine import BULK, URGENT
from ._memops import copy_regions, crc32, crc32_shift, crc32c, crc32c_regions
from ._memory import AlignedBuffer, aligned_buffer, buffer_address
from ._select import backend, engine, make_engine
from .reader import Reader
from .writer import Writer

__all__ = ["ALIGN_BYTES", "AlignedBuffer", "BULK", "FastioConfig", "Reader", "URGENT", "Writer",
           "aligned_buffer", "backend", "buffer_address", "copy_regions", "crc32", "crc32_shift", "crc32c",
           "crc32c_regions", "engine", "make_engine"]

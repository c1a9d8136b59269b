"""io_engine: asynchronous file IO into any buffer, with O_DIRECT, a thread pool and checksums.

No torch at its core: buffers are anything with the buffer protocol (numpy arrays, memoryview,
bytearray, mmap; for a CPU torch tensor pass `t.numpy()` / `t.view(torch.uint8).numpy()`).

Import its names from here (`from io_engine import IOEngine`), never from its modules; the one
module imported by name is the benchmark behind `tierzero bench-io`: `from io_engine import bench`.
"""

from .buffers import PAGE, aligned_empty
from .engine import IOEngine, IOFuture, checksum
from .errors import IOEngineError
from .files import PreallocatedFile, ReadOnlyFile, free_disk_bytes
from .owners import not_own, owner_gone, pid_alive, read_pid, temp_name
from .progress import Progress
from .safe_files import (MARKER, file_mode, folder_mode, make_folder, make_private, mark_own, marked_own, open_own,
                         remove_if_empty_own, replace_file)
from .sizes import exact_size, format_size, parse_size

__all__ = ["IOEngine", "IOFuture", "IOEngineError", "PreallocatedFile", "ReadOnlyFile", "aligned_empty", "checksum",
           "free_disk_bytes", "parse_size", "format_size", "exact_size", "PAGE", "not_own", "owner_gone", "pid_alive",
           "read_pid", "temp_name", "Progress", "MARKER", "file_mode", "folder_mode", "make_folder", "make_private",
           "mark_own", "marked_own", "open_own", "remove_if_empty_own", "replace_file"]
